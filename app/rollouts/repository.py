"""Every query on rollouts and their logged calls."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import RolloutRow, ToolCall


class RolloutRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def get(self, trace_id: str) -> RolloutRow | None:
        return await self.session.get(RolloutRow, trace_id)

    async def calls(self, trace_id: str) -> Sequence[ToolCall]:
        result = await self.session.scalars(
            select(ToolCall).where(ToolCall.trace_id == trace_id).order_by(ToolCall.started_at, ToolCall.id)
        )
        return result.all()

    async def mark_graded(
        self,
        trace_id: str,
        *,
        at: datetime | None = None,
        run: str | None = None,
        item_key: str | None = None,
    ) -> None:
        """Set graded_at; a graded trace that never called a tool gets its row here (first seen = `at`)."""
        at = at or datetime.now(UTC)
        dialect = self.session.get_bind().dialect.name
        insert: Any = postgresql.insert if dialect == "postgresql" else sqlite.insert
        statement = insert(RolloutRow).values(
            trace_id=trace_id, run=run, item_key=item_key, first_seen=at, last_seen=at, graded_at=at
        )
        await self.session.execute(
            statement.on_conflict_do_update(
                index_elements=[RolloutRow.trace_id], set_={"graded_at": statement.excluded.graded_at}
            )
        )
