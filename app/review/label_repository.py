"""Every query on people's labels of rollouts (`rollout_labels`), and the candidates of a labelling queue."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import aliased

from app.db.models import Grade, RolloutLabel, RolloutRow
from app.review.stats_repository import Queries


@dataclass(frozen=True)
class QueueCandidate:
    """An unlabelled rollout of a run, with the score of its latest grade (None: not graded)."""

    trace_id: str
    item_key: str | None
    score: float | None


class LabelRepository(Queries):
    async def get(self, trace_id: str) -> RolloutLabel | None:
        return await self.session.get(RolloutLabel, trace_id, populate_existing=True)

    async def put(self, trace_id: str, *, label: str, note: str | None, by: str, at: datetime) -> None:
        """Set the rollout's label (one per rollout: a second label replaces the first)."""
        insert: Any = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        values = {"label": label, "note": note, "labelled_by": by, "labelled_at": at}
        statement = insert(RolloutLabel).values(trace_id=trace_id, **values)
        await self.session.execute(
            statement.on_conflict_do_update(index_elements=[RolloutLabel.trace_id], set_=values)
        )

    async def delete(self, trace_id: str) -> bool:
        result = await self.session.execute(
            delete(RolloutLabel)
            .where(RolloutLabel.trace_id == trace_id)
            .returning(RolloutLabel.trace_id)
            .execution_options(synchronize_session=False)
        )
        return result.scalar_one_or_none() is not None

    async def of_run(self, run: str) -> dict[str, str]:
        """The labels of the run's rollouts: trace id → pass | fail."""
        query = (
            select(RolloutLabel.trace_id, RolloutLabel.label)
            .join(RolloutRow, RolloutRow.trace_id == RolloutLabel.trace_id)
            .where(RolloutRow.run == run)
        )
        return {row[0]: row[1] for row in (await self.session.execute(query)).all()}

    async def for_traces(self, trace_ids: Sequence[str]) -> dict[str, RolloutLabel]:
        if not trace_ids:
            return {}
        rows = await self.session.scalars(select(RolloutLabel).where(RolloutLabel.trace_id.in_(trace_ids)))
        return {row.trace_id: row for row in rows.all()}

    async def unlabelled_count(self, run: str) -> int:
        """How many rollouts of the run nobody labelled."""
        labelled = select(RolloutLabel.trace_id).where(RolloutLabel.trace_id == RolloutRow.trace_id).exists()
        query = select(func.count()).select_from(RolloutRow).where(RolloutRow.run == run, ~labelled)
        return int(await self.session.scalar(query) or 0)

    async def unlabelled(self, run: str, grader: str | None, *, cap: int) -> list[QueueCandidate]:
        """Up to `cap` unlabelled rollouts of the run with their latest score (of `grader`, if given)."""
        latest = aliased(Grade)
        newest = select(latest.id).where(latest.trace_id == RolloutRow.trace_id)
        if grader is not None:
            newest = newest.where(latest.grader == grader)
        newest_id = newest.order_by(latest.id.desc()).limit(1).correlate(RolloutRow).scalar_subquery()
        labelled = select(RolloutLabel.trace_id).where(RolloutLabel.trace_id == RolloutRow.trace_id).exists()
        query = (
            select(RolloutRow.trace_id, RolloutRow.item_key, Grade.score, Grade.item_key)
            .outerjoin(Grade, Grade.id == newest_id)
            .where(RolloutRow.run == run, ~labelled)
            .order_by(RolloutRow.trace_id)
            .limit(cap)
        )
        rows = (await self.session.execute(query)).all()
        return [QueueCandidate(trace_id=r[0], item_key=r[1] or r[3], score=r[2]) for r in rows]
