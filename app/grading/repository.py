"""Every query grading needs on stored grades."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import func, select, true
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Grade, KeptState, RolloutRow


class GradeRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    def add(self, grade: Grade) -> None:
        self.session.add(grade)

    async def for_trace(self, trace_id: str) -> Sequence[Grade]:
        result = await self.session.scalars(
            select(Grade).where(Grade.trace_id == trace_id).order_by(Grade.created_at, Grade.id)
        )
        return result.all()

    async def items_with_same_answer(
        self, answer_hash: str, *, exclude_item: str, run: str | None = None
    ) -> int:
        """How many other items got a grade with this answer hash (uses ix_grades_answer_hash)."""
        query = select(func.count(func.distinct(Grade.item_key))).where(
            Grade.answer_hash == answer_hash, Grade.item_key.is_not(None), Grade.item_key != exclude_item
        )
        if run is not None:
            query = query.where(Grade.run == run)
        return int(await self.session.scalar(query) or 0)

    async def latest_scores(self, run: str) -> dict[str, dict[str, float]]:
        """The score of the latest grade of each grader of each rollout of the run: grader → trace → score
        (a latest grade that failed gives no score)."""
        newest = (
            select(func.max(Grade.id))
            .where(Grade.trace_id.is_not(None), _of_run(run))
            .group_by(Grade.trace_id, Grade.grader)
        )
        query = select(Grade.grader, Grade.trace_id, Grade.score).where(Grade.id.in_(newest))
        scores: dict[str, dict[str, float]] = {}
        for grader, trace_id, score in (await self.session.execute(query)).all():
            if trace_id is not None and score is not None:
                scores.setdefault(grader, {})[trace_id] = float(score)
        return scores

    async def sources(self, grader: str, *, run: str | None, limit: int | None) -> Sequence[Grade]:
        """What a regrade by `grader` scores: the newest grade of any grader of each graded rollout (of
        `run`: the rollout's label, else the grade's), which holds the sample and row it was graded on;
        and the grades of `grader` posted without a trace, the newest of each distinct run, sample and
        row once (a regrade stores its grade of one beside it, with nothing to tell the two apart)."""
        newest = select(func.max(Grade.id)).where(Grade.trace_id.is_not(None))
        if run is not None:
            newest = newest.where(_of_run(run))
        query = (
            select(Grade)
            .where(
                (Grade.id.in_(newest.group_by(Grade.trace_id)))
                | ((Grade.grader == grader) & Grade.trace_id.is_(None) & _in_run(run))
            )
            .order_by(Grade.id.desc())
        )
        found: list[Grade] = []
        traceless: set[tuple[str | None, bytes, bytes]] = set()
        for grade in (await self.session.scalars(query)).all():
            if grade.trace_id is None:
                key = (grade.run, _canonical(grade.sample), _canonical(grade.item))
                if key in traceless:
                    continue
                traceless.add(key)
            found.append(grade)
        found.reverse()
        return found if limit is None else found[:limit]

    async def latest_of(self, grader: str, trace_ids: Sequence[str]) -> Sequence[Grade]:
        """The newest grade of `grader` of each of these rollouts that it graded."""
        found: list[Grade] = []
        for start in range(0, len(trace_ids), 1000):  # bounded IN lists on either database
            newest = (
                select(func.max(Grade.id))
                .where(Grade.grader == grader, Grade.trace_id.in_(trace_ids[start : start + 1000]))
                .group_by(Grade.trace_id)
            )
            found.extend((await self.session.scalars(select(Grade).where(Grade.id.in_(newest)))).all())
        return found

    async def ungraded(self, run: str) -> int:
        """How many rollouts of the run no grader ever graded (no answer is stored to grade them on)."""
        graded = select(Grade.trace_id).where(Grade.trace_id == RolloutRow.trace_id).exists()
        query = select(func.count()).select_from(RolloutRow).where(RolloutRow.run == run, ~graded)
        return int(await self.session.scalar(query) or 0)


def _of_run(run: str) -> Any:
    """A grade of a rollout of the run: by the rollout's label, else by the grade's."""
    return Grade.trace_id.in_(select(RolloutRow.trace_id).where(RolloutRow.run == run)) | (Grade.run == run)


def _in_run(run: str | None) -> Any:
    return Grade.run == run if run is not None else true()


def _canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)


class KeptStateRepository:
    """The kept final states of rollouts (`kept_states`)."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def get(self, trace_id: str) -> dict[str, Any] | None:
        row = await self.session.get(KeptState, trace_id)
        return dict(row.changes) if row is not None else None

    async def keep(self, trace_id: str, changes: Mapping[str, Any], *, at: datetime) -> None:
        """Keep the rollout's changes, replacing what an earlier grade kept (the newer state wins)."""
        insert: Any = (
            postgresql.insert if self.session.get_bind().dialect.name == "postgresql" else sqlite.insert
        )
        statement = insert(KeptState).values(trace_id=trace_id, changes=dict(changes), kept_at=at)
        await self.session.execute(
            statement.on_conflict_do_update(
                index_elements=[KeptState.trace_id],
                set_={"changes": statement.excluded.changes, "kept_at": statement.excluded.kept_at},
            )
        )
