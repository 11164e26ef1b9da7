"""The one family of shapes a rollout is read back in: its calls, its grades, its summary and its detail.

`RolloutBase` holds what every read of a rollout shows; `RolloutSummary` (a row of the rollout list)
and `RolloutDetail` (one rollout: its timeline and grades) inherit it. `RolloutCall` is the one shape
of a logged call. The count of a rollout's logged calls is `call_count` everywhere; `timeline` is the
list of the calls themselves. The admin routes, the review, the graders and the flags read these.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict


class RolloutCall(BaseModel):
    """One logged call of a rollout, as stored (arguments as the model sent them)."""

    model_config = ConfigDict(frozen=True)

    seq: int  # order of start, 0-based
    batch: int  # parallel batch index: calls that overlapped in time share a batch
    tool: str
    call_id: str | None
    arguments: str  # as sent: usually a JSON object's text, else whatever the model wrote
    output: str | None  # what the model read (None when the call failed before answering)
    output_bytes: int
    outcome: str  # ok | model_error | replayed | call_id_reused | tool_crash | infra_error
    error: str | None
    status_code: int
    started_at: datetime  # where it is placed: an answer at its call's first start (app/db/call_log.py)
    ended_at: datetime
    latency_ms: float
    worker: str
    channel: str = "rft"  # rft: the tool routes; mcp: the MCP server
    # Names of the review flags that cite this call as evidence (filled when grades are read with it).
    flags: tuple[str, ...] = ()

    def parsed_arguments(self) -> Any:
        """The arguments as JSON ({} when empty), or the raw text when they are not JSON."""
        if not self.arguments:
            return {}
        try:
            return orjson.loads(self.arguments)
        except orjson.JSONDecodeError:
            return self.arguments


# The fields of a call that come from its logged row (the rest are numbered or cited on reading).
LOGGED_CALL_FIELDS = tuple(name for name in RolloutCall.model_fields if name not in ("seq", "batch", "flags"))


class FlagOut(BaseModel):
    name: str
    reason: str
    evidence: list[int]  # seq of the calls that show it


class GradeOut(BaseModel):
    id: int
    grader: str
    grader_version: str
    status: str
    score: float | None
    sub_scores: dict[str, Any]
    flags: list[FlagOut]
    errors: list[Any]
    answer: str
    answer_hash: str | None
    item_key: str | None
    run: str | None
    latency_ms: float
    created_at: datetime


class RolloutBase(BaseModel):
    """What every read of a rollout shows; first_seen/last_seen are None when only its grades exist."""

    trace_id: str
    run: str | None
    channel: str | None  # of the first logged call: rft (the tool routes) or mcp (the MCP server)
    item_key: str | None
    first_seen: datetime | None
    last_seen: datetime | None
    graded_at: datetime | None
    call_count: int  # logged calls of the rollout


class RolloutSummary(RolloutBase):
    """A row of the rollout list, with its latest grade (of the grader asked for, if any)."""

    grader: str | None
    status: str | None  # of the latest grade; None: not graded
    score: float | None
    flags: list[str]
    label: str | None = None  # a person's judgment: pass | fail (None: not labelled)


class TranscriptOut(BaseModel):
    """A rollout's conversation as stored (the shape: sparring.conversation)."""

    model: str | None
    source: str | None
    messages: list[dict[str, Any]]
    size_bytes: int
    stored_at: datetime


class RolloutDetail(RolloutBase):
    """One rollout: its calls in start order with their parallel batches, and its grades (oldest first)."""

    parallel_batches: int
    timeline: list[RolloutCall]
    grades: list[GradeOut] = []
    # The conversation, when sparring ran the loop or the trainer stored it (PUT .../transcript).
    transcript: TranscriptOut | None = None
