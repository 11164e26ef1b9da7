"""What names a rollout and its calls on the wire: column limits, `fit`, the run header, the item key,
and how deeply the JSON they carry may nest.

Both request paths (tool calls and grades) import these, so a trace id, a run label or an item key is
stored the same way whichever path saw it first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from app.db.text import storable

TRACE_ID_MAX = 128  # rollouts.trace_id, tool_calls.trace_id, grades.trace_id
CALL_ID_MAX = 200  # tool_calls.call_id and request_id
RUN_MAX = 200  # the X-Sparring-Run label
RUN_HEADER = "X-Sparring-Run"  # labels a training run; stored with every rollout, call and grade

ITEM_ID_FIELDS = ("id", "item_id", "task_id", "uid")
ITEM_KEY_MAX = 128  # rollouts.item_key, grades.item_key

# How deeply arguments, items and samples may nest: orjson writes at most 255 levels and Postgres
# parses a few hundred before its stack limit; no tool call or dataset row needs more.
JSON_DEPTH_MAX = 128


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


def call_key(value: str | None) -> str | None:
    """A call_id as the store's ledger and the log both key it (see `trace_key`); None stays None."""
    return storable(fit(value, CALL_ID_MAX)) if value else None


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
    import orjson  # here, not at the top: the trainer-side client imports this module without it

    dumped = orjson.dumps(item, option=orjson.OPT_SORT_KEYS, default=str)
    if b"\\u0000" in dumped:  # hash the row as it is stored (NUL as U+FFFD), so the log and grades agree
        dumped = orjson.dumps(storable(item), option=orjson.OPT_SORT_KEYS, default=str)
    digest = hashlib.sha256(dumped).hexdigest()
    return f"sha256:{digest[:40]}"
