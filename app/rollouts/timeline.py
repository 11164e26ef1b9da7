"""A rollout read back: its logged calls as read (app/db/call_log.py), numbered, with their parallel batches.

This is the one shape of a logged call (`RolloutCall`) and of a rollout's timeline (`RolloutTimeline`):
the admin routes, the review, the export and the graders all read a rollout through `read_timeline`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

import orjson
from pydantic import BaseModel, ConfigDict
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Rollout
from app.rollouts.repository import RolloutRepository


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

    def parsed_arguments(self) -> Any:
        """The arguments as JSON ({} when empty), or the raw text when they are not JSON."""
        if not self.arguments:
            return {}
        try:
            return orjson.loads(self.arguments)
        except orjson.JSONDecodeError:
            return self.arguments


class RolloutTimeline(BaseModel):
    """A rollout and its calls; the row's fields are None when only its calls or grades exist."""

    trace_id: str
    run: str | None
    channel: str | None  # of the rollout's first logged call
    item_key: str | None
    first_seen: datetime | None
    last_seen: datetime | None
    graded_at: datetime | None
    parallel_batches: int
    calls: Sequence[RolloutCall]


class LoggedCall(Protocol):
    """A row of the log as read (`app.db.call_log.logged_calls`): `started_at` is where it is placed."""

    @property
    def started_at(self) -> datetime: ...
    @property
    def ended_at(self) -> datetime: ...


def parallel_batches(calls: Sequence[LoggedCall]) -> list[int]:
    """Batch index per call (calls in start order): calls that overlapped in time share a batch."""
    batches: list[int] = []
    batch = -1
    batch_end: datetime | None = None
    for call in calls:
        if batch_end is None or call.started_at >= batch_end:
            batch += 1
            batch_end = call.ended_at
        else:
            batch_end = max(batch_end, call.ended_at)
        batches.append(batch)
    return batches


_LOGGED = tuple(name for name in RolloutCall.model_fields if name not in ("seq", "batch"))


def rollout_calls(calls: Sequence[LoggedCall]) -> list[RolloutCall]:
    """The logged calls (in start order) numbered, with the parallel batch each belongs to."""
    batches = parallel_batches(calls)
    return [
        RolloutCall(seq=i, batch=batches[i], **{name: getattr(c, name) for name in _LOGGED})
        for i, c in enumerate(calls)
    ]


def build_timeline(trace_id: str, rollout: Rollout | None, calls: Sequence[LoggedCall]) -> RolloutTimeline:
    numbered = rollout_calls(calls)
    return RolloutTimeline(
        trace_id=trace_id,
        run=rollout.run if rollout else None,
        channel=rollout.channel if rollout else None,
        item_key=rollout.item_key if rollout else None,
        first_seen=rollout.first_seen if rollout else None,
        last_seen=rollout.last_seen if rollout else None,
        graded_at=rollout.graded_at if rollout else None,
        parallel_batches=(numbered[-1].batch + 1) if numbered else 0,
        calls=numbered,
    )


async def read_timeline(session: AsyncSession, trace_id: str) -> RolloutTimeline | None:
    """The rollout's row and logged calls; None when the server has neither."""
    repo = RolloutRepository(session)
    rollout = await repo.get(trace_id)
    calls = await repo.calls(trace_id)
    if rollout is None and not calls:
        return None
    return build_timeline(trace_id, rollout, calls)
