"""Every query grading needs: stored grades, and the rollout row a grade belongs to."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Grade, Rollout


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

    async def touch_rollout(
        self, trace_id: str, *, run: str | None, item_key: str | None, graded_at: datetime, exists: bool
    ) -> None:
        """Mark the rollout graded; a graded trace that never called a tool gets its row here."""
        if exists:
            await self.session.execute(
                update(Rollout).where(Rollout.trace_id == trace_id).values(graded_at=graded_at)
            )
            return
        dialect = self.session.get_bind().dialect.name
        insert: Any = postgresql.insert if dialect == "postgresql" else sqlite.insert
        statement = insert(Rollout).values(
            trace_id=trace_id,
            run=run,
            item_key=item_key,
            first_seen=graded_at,
            last_seen=graded_at,
            graded_at=graded_at,
        )
        await self.session.execute(
            statement.on_conflict_do_update(
                index_elements=[Rollout.trace_id], set_={"graded_at": statement.excluded.graded_at}
            )
        )
