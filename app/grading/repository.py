"""Every query grading needs: stored grades, and the rollout's recorded calls."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
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
