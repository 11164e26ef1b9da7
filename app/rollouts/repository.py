"""Every query on rollouts and their logged calls."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Row, func
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.call_log import logged_calls
from app.db.models import RolloutRow, ToolCall


class RolloutRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def get(self, trace_id: str) -> RolloutRow | None:
        return await self.session.get(RolloutRow, trace_id)

    async def calls(self, trace_id: str, rollout: RolloutRow | None = None) -> Sequence[Row[Any]]:
        """The rollout's calls as read (app/db/call_log.py): each answer at its call's first start.
        `rollout`: its row, when it has one: its span (first_seen to last_seen) is the days to read."""
        span = {"since": rollout.first_seen, "until": rollout.last_seen} if rollout is not None else {}
        rows: Sequence[Row[Any]] = (
            await self.session.execute(logged_calls(ToolCall.trace_id == trace_id, **span))
        ).all()
        return rows

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
        # The newer of the two: grades of one rollout may commit out of order, and an older graded_at
        # would make the rollout old for `sparring prune` while a newer grade of it is not.
        newer = func.greatest if dialect == "postgresql" else func.max  # SQLite's max of two is scalar
        graded_at = newer(
            func.coalesce(RolloutRow.graded_at, statement.excluded.graded_at), statement.excluded.graded_at
        )
        await self.session.execute(
            statement.on_conflict_do_update(
                index_elements=[RolloutRow.trace_id], set_={"graded_at": graded_at}
            )
        )
