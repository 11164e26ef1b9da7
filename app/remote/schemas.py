"""The wire shapes of eval-protocol's remote rollout processor (eval-protocol 0.3.33), read tolerantly.

`POST <prefix>/init` takes `eval_protocol.types.remote_rollout_processor.InitRequest`
(`completion_params` with `model`, `messages`, `tools`, `model_base_url`, `metadata` with the
invocation, experiment, rollout, run and row ids, `api_key`); earlier releases sent `rollout_id` and
`model` at the top level, which are read too. `item` (the dataset row's fields, for grading at the
end) and `pack` (whose tools to offer when `tools` is absent) are sparring's own additions.
`GET <prefix>/status` answers a superset of eval-protocol's `StatusResponse` (`terminated`, `info`,
`status` as an AIP-193 status with eval-protocol's codes). Processors of 0.3.x poll that route; the
0.3.33 processor polls its tracing gateway instead, so a rollout's end is also posted there, as the
gateway log (`POST <gateway>/logs`) eval-protocol's own logging handler writes.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.db.text import has_control_character, nul_inside
from app.errors import BadRequest, InvalidRequest, describe_validation_errors
from sparring.policies import RESERVED_REQUEST_KEYS
from sparring.wire import JSON_DEPTH_MAX, nested_deeper_than, remote_trace_id

# eval-protocol's Status.Code values (google.rpc codes plus its own 100+).
CODE_FINISHED = 100
CODE_RUNNING = 101
CODE_ABORTED = 10
CODE_INTERNAL = 13
CODE_UNAVAILABLE = 14
CODE_DEADLINE_EXCEEDED = 4
CODE_INVALID_ARGUMENT = 3

# The trace id of a rollout is derived from its rollout id (the client computes it the same way).
trace_id_for = remote_trace_id


class RolloutMetadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    invocation_id: str | None = None
    experiment_id: str | None = None
    rollout_id: str | None = None
    run_id: str | None = None
    row_id: str | None = None


class InitRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    completion_params: dict[str, Any] = Field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    model_base_url: str | None = None
    metadata: RolloutMetadata = Field(default_factory=RolloutMetadata)
    api_key: str | None = None
    # Earlier eval-protocol releases.
    rollout_id: str | None = None
    model: str | None = None
    # sparring's additions.
    item: dict[str, Any] | None = None
    pack: str | None = None
    status_log_url: str | None = None


class RolloutPlan(BaseModel):
    """An init request checked and resolved into what the runner needs."""

    rollout_id: str
    trace_id: str
    run: str | None
    model: str
    base_url: str
    api_key: str | None
    sampling: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    pack: str | None
    item: dict[str, Any] | None
    # Where the end of the rollout is posted as a tracing-gateway log, and the tags it carries.
    status_log_url: str | None = None
    tags: list[str] = []
    # Which run of the rollout this is: a retry of one that failed is the next attempt, on its own trace.
    attempt: int = 1

    def as_attempt(self, attempt: int) -> RolloutPlan:
        """This rollout as its attempt `attempt`, with that attempt's trace."""
        return self.model_copy(
            update={"attempt": attempt, "trace_id": trace_id_for(self.rollout_id, attempt)}
        )

    def stored_request(self) -> dict[str, Any]:
        """What is kept with the rollout: everything but the model's API key."""
        return self.model_dump(exclude={"api_key"})


ROLLOUT_ID_MAX = 200  # remote_rollouts.rollout_id


def parse_init(body: bytes) -> InitRequest:
    """An init request's body, read as the tool and grade routes read theirs; what no database or JSON
    encoder can keep is refused here (400), before anything is stored or run.

    orjson refuses what JSON has no value for: NaN, Infinity, a number past the largest double, a
    lone surrogate. Nesting past JSON_DEPTH_MAX and NUL (which Postgres text and JSON cannot hold)
    are refused as the other routes refuse them; wrong field types are a 422.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object (an init request)")
    for name, value in data.items():
        if nested_deeper_than(value):
            raise BadRequest(f"{name[:64]!r} nests more than {JSON_DEPTH_MAX} levels deep")
        if nul_inside(value) or "\x00" in name:
            raise BadRequest(f"{name[:64]!r} holds a NUL character, which sparring cannot store")
    try:
        return InitRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(
            "the init request's fields do not have the types eval-protocol sends",
            errors=describe_validation_errors(exc.errors()),
        ) from exc


def check_rollout_id(rollout_id: str) -> str:
    """A rollout id as its column holds it: at most ROLLOUT_ID_MAX characters, no control character."""
    if len(rollout_id) > ROLLOUT_ID_MAX:
        raise BadRequest(f"the rollout id is longer than {ROLLOUT_ID_MAX} characters")
    if has_control_character(rollout_id):
        raise BadRequest("the rollout id contains a control character (NUL, CR, LF, ...)")
    return rollout_id


# completion_params keys that are not sampling parameters of the model call.
_NOT_SAMPLING = {"model", "base_url", "api_key", "api_base", "model_kwargs", "extra_body"}
_RUN_MAX = 200


def plan(init: InitRequest) -> RolloutPlan:
    """Check an init request; what is missing is the trainer's configuration error (400)."""
    rollout_id = init.metadata.rollout_id or init.rollout_id
    if not rollout_id:
        raise BadRequest("the init request has no rollout id (metadata.rollout_id)")
    check_rollout_id(rollout_id)
    params = init.completion_params
    model = params.get("model") or init.model
    if not isinstance(model, str) or not model:
        raise BadRequest("the init request names no model (completion_params.model)")
    base_url = init.model_base_url or params.get("base_url") or params.get("api_base")
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise BadRequest("the init request gives no http(s) model base URL (model_base_url)")
    if not init.messages:
        raise BadRequest("the init request has no messages")
    sampling = {k: v for k, v in params.items() if k not in _NOT_SAMPLING}
    # Parameters nested for the client libraries (LiteLLM, the openai SDK), which send them in the body.
    for nested in ("model_kwargs", "extra_body"):
        kwargs = params.get(nested)
        if isinstance(kwargs, dict):
            sampling.update(kwargs)
    # What the policy writes into every request itself: the init's messages and tools, and whole answers
    # (`stream`, which eval-protocol's processors take, would make them an event stream sparring cannot read).
    for key in RESERVED_REQUEST_KEYS:
        sampling.pop(key, None)
    meta = init.metadata
    run = ":".join(part for part in (meta.experiment_id, meta.run_id) if part) or None
    tags = [f"rollout_id:{rollout_id}"] + [
        f"{name}:{value}"
        for name, value in (("experiment_id", meta.experiment_id), ("run_id", meta.run_id))
        if value
    ]
    return RolloutPlan(
        rollout_id=rollout_id,
        trace_id=trace_id_for(rollout_id),
        run=run[:_RUN_MAX] if run else None,
        model=model,
        base_url=base_url,
        api_key=init.api_key or (params.get("api_key") if isinstance(params.get("api_key"), str) else None),
        sampling=sampling,
        messages=init.messages,
        tools=init.tools,
        pack=init.pack,
        item=init.item,
        status_log_url=init.status_log_url or gateway_logs_url(base_url),
        tags=tags,
    )


def gateway_logs_url(model_base_url: str) -> str | None:
    """The logs route of an eval-protocol tracing gateway, from a model URL it built for a rollout.

    Such URLs read `<gateway>/rollout_id/<id>/invocation_id/<id>/...`; any other model URL has none.
    """
    marker = model_base_url.find("/rollout_id/")
    return f"{model_base_url[:marker]}/logs" if marker > 0 else None


class InitResponse(BaseModel):
    """`POST <prefix>/init`'s answer: the rollout accepted, the trace id and number of its current
    attempt, and whether this call started that attempt (False when the rollout is running or finished:
    only a rollout whose last attempt failed runs again)."""

    rollout_id: str
    trace_id: str
    run: str | None
    accepted: bool
    started: bool
    attempt: int


class RolloutStatus(BaseModel):
    """An AIP-193 status as eval-protocol reads it: its code (FINISHED, RUNNING, an error's) and message."""

    code: int
    message: str
    details: list[Any] = []


class StatusResponse(BaseModel):
    """`GET <prefix>/status`'s answer: eval-protocol's StatusResponse (`terminated`, `status`, `info`)
    plus sparring's own fields, all of the current attempt. `info` carries its summary (turns, calls,
    tokens, ...) and `earlier_attempts`, the attempts that failed before it."""

    terminated: bool
    rollout_id: str
    trace_id: str
    attempt: int
    state: str
    reason: str | None
    reward: float | None
    status: RolloutStatus
    info: dict[str, Any]
