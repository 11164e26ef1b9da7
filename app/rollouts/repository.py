"""Every query on rollouts and their logged calls."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Rollout, ToolCall


class RolloutRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def get(self, trace_id: str) -> Rollout | None:
        return await self.session.get(Rollout, trace_id)

    async def calls(self, trace_id: str) -> Sequence[ToolCall]:
        result = await self.session.scalars(
            select(ToolCall).where(ToolCall.trace_id == trace_id).order_by(ToolCall.started_at, ToolCall.id)
        )
        return result.all()

    async def recent(self, *, limit: int, run: str | None) -> Sequence[tuple[Rollout, int]]:
        query = select(Rollout).order_by(Rollout.last_seen.desc()).limit(limit)
        if run is not None:
            query = query.where(Rollout.run == run)
        result = await self.session.scalars(query)
        # rollouts.calls is recounted by the log writer in the transaction that logs the calls.
        return [(rollout, rollout.calls) for rollout in result.all()]

    async def mark_graded(self, trace_id: str) -> None:
        await self.session.execute(
            update(Rollout).where(Rollout.trace_id == trace_id).values(graded_at=datetime.now(UTC))
        )


def parallel_batches(calls: Sequence[ToolCall]) -> list[int]:
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
