"""Every query grading needs on stored grades."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Grade


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

    async def latest(self, grader: str, *, run: str | None, limit: int | None) -> Sequence[Grade]:
        """The newest grade of `grader` for each rollout (grades without a trace each count once)."""
        newest = (
            select(func.max(Grade.id))
            .where(Grade.grader == grader, Grade.trace_id.is_not(None))
            .group_by(Grade.trace_id)
        )
        query = (
            select(Grade)
            .where((Grade.id.in_(newest)) | ((Grade.grader == grader) & Grade.trace_id.is_(None)))
            .order_by(Grade.id)
        )
        if run is not None:
            query = query.where(Grade.run == run)
        if limit is not None:
            query = query.limit(limit)
        result = await self.session.scalars(query)
        return result.all()
