"""A rollout read back: its logged calls as read (app/db/call_log.py), numbered, with their parallel batches.

The admin routes, the review, the export and the graders all read a rollout through `read_timeline`,
in the shapes of app/rollouts/shapes.py (`RolloutDetail`, `RolloutCall`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Protocol

from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import RolloutRow
from app.rollouts.repository import RolloutRepository
from app.rollouts.shapes import LOGGED_CALL_FIELDS, RolloutCall, RolloutDetail


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


def rollout_calls(calls: Sequence[LoggedCall]) -> list[RolloutCall]:
    """The logged calls (in start order) numbered, with the parallel batch each belongs to."""
    batches = parallel_batches(calls)
    return [
        RolloutCall(seq=i, batch=batches[i], **{name: getattr(c, name) for name in LOGGED_CALL_FIELDS})
        for i, c in enumerate(calls)
    ]


def build_timeline(trace_id: str, rollout: RolloutRow | None, calls: Sequence[LoggedCall]) -> RolloutDetail:
    numbered = rollout_calls(calls)
    return RolloutDetail(
        trace_id=trace_id,
        run=rollout.run if rollout else None,
        channel=rollout.channel if rollout else None,
        item_key=rollout.item_key if rollout else None,
        first_seen=rollout.first_seen if rollout else None,
        last_seen=rollout.last_seen if rollout else None,
        graded_at=rollout.graded_at if rollout else None,
        call_count=len(numbered),
        parallel_batches=(numbered[-1].batch + 1) if numbered else 0,
        timeline=numbered,
    )


async def read_timeline(session: AsyncSession, trace_id: str) -> RolloutDetail | None:
    """The rollout's row and logged calls; None when the server has neither."""
    repo = RolloutRepository(session)
    rollout = await repo.get(trace_id)
    calls = await repo.calls(trace_id, rollout)
    if rollout is None and not calls:
        return None
    return build_timeline(trace_id, rollout, calls)
