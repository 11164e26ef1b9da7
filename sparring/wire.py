"""The wire contract server and client share: the call envelope, id rules and limits, the outcome names.

The server (`app/`) and the client (`sparring.*`) both import this module, so a trace id, a run label
or an item key is written the same way on both sides, and a call's outcome has one name everywhere:
in the call log, the metrics, the review pages, the flags and the client's failure reports.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Final, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, field_validator

T = TypeVar("T")

# ---- Outcomes ----------------------------------------------------------------------------------------

Outcome = Literal["ok", "model_error", "call_id_reused", "tool_crash", "infra_error", "replayed", "refused"]
"""How one tool call (or grade) ended:

- `ok`: answered, the output the model reads;
- `model_error`: answered with an `Error: ...` output the model can read (a bad argument, a refusal);
- `call_id_reused`: answered with an `Error: ...`: the call_id already named a different call;
- `tool_crash`: the tool raised (HTTP 500); the trainer retries, then discards the rollout;
- `infra_error`: the environment failed (an outage, a timeout, a 5xx, no answer at all: HTTP 503);
- `replayed`: a retry answered from the ledger with the first answer, the tool not run again;
- `refused`: the server refused the request itself (a 4xx to a grade, but a 408 or 429: a key, a grader
  name, a body to fix); another try would meet the same answer.
"""

OK: Final = "ok"
MODEL_ERROR: Final = "model_error"
CALL_ID_REUSED: Final = "call_id_reused"
USER_CALL_PREFIX: Final = "user_"  # the call ids of a simulated user's own calls (never an agent's)
TOOL_CRASH: Final = "tool_crash"
INFRA_ERROR: Final = "infra_error"
REPLAYED: Final = "replayed"
REFUSED: Final = "refused"

OUTCOMES: tuple[Outcome, ...] = (OK, MODEL_ERROR, CALL_ID_REUSED, TOOL_CRASH, INFRA_ERROR, REPLAYED, REFUSED)
ANSWERED_OUTCOMES: tuple[Outcome, ...] = (OK, MODEL_ERROR)
"""An attempt that ran its call and answered it (the trainer did not retry it)."""
ANSWERS: tuple[Outcome, ...] = (OK, MODEL_ERROR, REPLAYED)
"""An attempt that answered its call: it ran the tool, or replayed the ledger's earlier answer."""
ENVIRONMENT_FAILURES: tuple[Outcome, ...] = (TOOL_CRASH, INFRA_ERROR)
"""The environment failed the call: the trainer retries it with the same call_id, then discards."""

FailureKind = Literal["tool_crash", "infra_error", "refused"]
"""Why a tool call or a grade gave nothing to use, on whichever path it went (HTTP or in-process)."""


# The 4xx that say "not now" (too slow a request, too many of them): another try may pass.
TRANSIENT_4XX: Final = frozenset({408, 429})


def failure_kind_of_status(status: int) -> FailureKind:
    """The failure an HTTP answer stands for: 500 is a crash, another 5xx (or a 408 or 429) the
    environment, another 4xx a refusal."""
    if status == 500:
        return TOOL_CRASH
    if status >= 500 or status in TRANSIENT_4XX:
        return INFRA_ERROR
    return REFUSED


# ---- Names and limits --------------------------------------------------------------------------------

TRACE_ID_MAX = 128  # rollouts.trace_id, tool_calls.trace_id, grades.trace_id
CALL_ID_MAX = 200  # tool_calls.call_id and request_id
RUN_MAX = 200  # the X-Sparring-Run label
RUN_HEADER = "X-Sparring-Run"  # labels a training run; stored with every rollout, call and grade
# The `_meta` key of a JSON-RPC tools/call (MCP, OpenEnv's `/mcp`) naming the call as `call_id` does on
# the tool routes: a client's retry is a new request with a new id, so only an id of the client's own
# makes a retry after an outage (a 503 whose call may have been applied) the same call.
CALL_ID_META = "sparring/call_id"

ITEM_ID_FIELDS = ("id", "item_id", "task_id", "uid")
ITEM_KEY_MAX = 128  # rollouts.item_key, grades.item_key

# How deeply arguments, items and samples may nest: orjson writes at most 255 levels and Postgres
# parses a few hundred before its stack limit; no tool call or dataset row needs more.
JSON_DEPTH_MAX = 128

# Trace ids of remote rollouts are derived from rollout ids in this namespace (by sparring and its client).
REMOTE_TRACE_NAMESPACE = uuid.UUID("5d0f6c1e-8a44-4c7a-9b0e-3f1c2a7d9e61")


def new_trace_id() -> str:
    """A rollout id as the training service makes them: `trace_` and a UUID4 as 32 hex digits."""
    return f"trace_{uuid.uuid4().hex}"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def remote_trace_id(rollout_id: str, attempt: int = 1) -> str:
    """The `trace_id` sparring gives attempt `attempt` of the remote rollout `rollout_id`
    (`POST /remote/init`): the first attempt's, and `<first>_<n>` for the n-th (a retry of a rollout
    that failed runs anew, with a state of its own).

    An eval-protocol evaluator grades the rollout with it, without asking the server; the end the
    server posts to the tracing gateway names it too (`extras.trace_id`), retries included.
    """
    first = f"trace_{uuid.uuid5(REMOTE_TRACE_NAMESPACE, rollout_id).hex}"
    return first if attempt <= 1 else f"{first}_{attempt}"


NUL = "\x00"
REPLACEMENT = "\ufffd"


def storable(value: T) -> T:
    """`value` with every NUL in its strings (dict keys included) replaced by U+FFFD.

    Postgres text and JSON cannot hold NUL; this is applied on both backends, so a trace_id holding a
    NUL names the same rollout in the call log, the grades and every lookup. Values without a NUL are
    returned as they are.
    """
    if isinstance(value, str):
        return value.replace(NUL, REPLACEMENT) if NUL in value else value  # type: ignore[return-value]
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}  # type: ignore[return-value]
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]  # type: ignore[return-value]
    return value


def nested_deeper_than(value: Any, limit: int = JSON_DEPTH_MAX) -> bool:
    """Whether objects and arrays in `value` nest more than `limit` levels (a scalar is level 0)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


_DIGEST_CHARS = 64  # sha256, hex
_HEX = frozenset("0123456789abcdef")


def _looks_abbreviated(value: str) -> bool:
    tail = value[-_DIGEST_CHARS - 1 :]
    return len(tail) == _DIGEST_CHARS + 1 and tail[0] == "~" and _HEX.issuperset(tail[1:])


def fit(value: str, limit: int) -> str:
    """`value` itself when it fits the column, else its head and a hash of the whole (stable, distinct).

    A value that fits but already ends like an abbreviation (`~` and 64 hex digits) is abbreviated
    too, so an id written as another's abbreviation can never stand for it: two distinct values
    never fit alike (short of a sha256 collision).
    """
    if len(value) <= limit and not _looks_abbreviated(value):
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()
    return f"{value[: max(0, limit - len(digest) - 1)]}~{digest}"


def trace_key(value: str) -> str:
    """A trace_id as the store and the log both key it: fitted to its column, NUL stored as U+FFFD.

    Computed once where a request is parsed, so the rollout's Redis keys and its SQL rows name it alike.
    """
    return storable(fit(value, TRACE_ID_MAX))


def path_trace_key(value: str) -> str:
    """A trace_id as a route's path names it: the id the calls sent, or the key it is stored under.

    The review lists and links a rollout by its stored key, a client names it by its own id; both must
    reach it. A stored key fits the column, so a longer value is an id as sent, keyed like the calls'.
    A value that fits is taken as the stored key, which it is for every id that fits the column and
    does not end like an abbreviation (`fit` is not applied again: a key that ends in its digest would
    be abbreviated twice, into a rollout nobody logged).
    """
    return trace_key(value) if len(value) > TRACE_ID_MAX else storable(value)


def call_key(value: str | None) -> str | None:
    """A call_id as the store's ledger and the log both key it (see `trace_key`); None stays None."""
    return storable(fit(value, CALL_ID_MAX)) if value else None


def json_bytes(
    value: Any,
    *,
    default: Callable[[Any], Any] | None = None,
    indent: bool = False,
    non_str_keys: bool = False,
) -> bytes:
    """`value` as orjson writes it, compact or indented by 2, with `default` for what JSON has no type for
    (and keys of any type with `non_str_keys`). What orjson cannot write, an integer beyond 64 bits (a
    tool's result, a model's arguments, a number Postgres' JSONB gives back for 1e20), Python's json
    writes, times as orjson writes them (RFC 3339)."""
    import orjson  # here, not at the top: most users of this module write no JSON

    option = (orjson.OPT_INDENT_2 if indent else 0) | (orjson.OPT_NON_STR_KEYS if non_str_keys else 0)
    try:
        return orjson.dumps(value, default=default, option=option)
    except TypeError as exc:
        if "64-bit" not in str(exc):
            raise

    def written(item: Any) -> Any:
        if isinstance(item, datetime):
            return item.isoformat()
        if default is None:
            raise TypeError(f"cannot serialize {type(item).__name__}")
        return default(item)

    text = json.dumps(
        value,
        default=written,
        ensure_ascii=False,
        indent=2 if indent else None,
        separators=None if indent else (",", ":"),
    )
    return text.encode()


def sorted_json(item: Any, *, default: Callable[[Any], Any] = str) -> bytes:
    """`item` as compact JSON with its keys sorted, the bytes a digest is taken of; `default` writes what
    JSON has no type for. Not `json_bytes`: its fallback escapes non-ASCII text, as the digests stored in
    the log and the ledger were taken (written otherwise, a row's item key would change)."""
    import orjson  # here, not at the top: most users of this module never hash a row

    try:
        return orjson.dumps(item, option=orjson.OPT_SORT_KEYS, default=default)
    except TypeError:
        # orjson writes no integer beyond 64 bits; a dataset read with `json`, or an in-process caller's
        # arguments, may hold one.
        return json.dumps(item, sort_keys=True, default=default, separators=(",", ":")).encode()


def item_key(item: Mapping[str, Any]) -> str | None:
    """A stable key for the dataset row: its id field if it has one, else a hash of the whole row."""
    if not item:
        return None
    for name in ITEM_ID_FIELDS:
        value = item.get(name)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return fit(f"{name}:{value}", ITEM_KEY_MAX)  # a long id cut with a hash: never merged
    if nested_deeper_than(item):
        return None  # refused where it arrives (an `Error:` output, a 400); orjson cannot write it
    dumped = sorted_json(item)
    if b"\\u0000" in dumped:  # hash the row as it is stored (NUL as U+FFFD), so the log and grades agree
        dumped = sorted_json(storable(item))
    digest = hashlib.sha256(dumped).hexdigest()
    return f"sha256:{digest[:40]}"


# ---- The tool-call envelope --------------------------------------------------------------------------


def _text_or_none(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return value
    # Tolerated as their text, but `str()` recurses: a list nested 1,000 levels would crash it.
    if nested_deeper_than(value):
        raise ValueError(f"nests more than {JSON_DEPTH_MAX} levels deep; an id or a name is text")
    return str(value)


class ToolCallEnvelope(BaseModel):
    """The Responses `function_call` item a tool route receives.

    Every field optional and unknown fields ignored: curl tests and alpha endpoints send less.
    """

    model_config = ConfigDict(extra="ignore")

    type: str | None = None
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: Any = None
    trace_id: str | None = None
    item: dict[str, Any] = {}

    @field_validator("type", "id", "call_id", "name", "trace_id", mode="before")
    @classmethod
    def _as_text(cls, value: Any) -> str | None:
        return _text_or_none(value)

    @field_validator("item", mode="before")
    @classmethod
    def _as_mapping(cls, value: Any) -> dict[str, Any]:
        return value if isinstance(value, dict) else {}


class ToolCallOutput(BaseModel):
    """The `function_call_output` a tool route answers."""

    type: str = "function_call_output"
    call_id: str | None
    id: str | None
    output: str
