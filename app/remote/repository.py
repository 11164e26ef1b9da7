"""Every query on remote rollouts."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import RemoteRollout


class RemoteRolloutRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def get(self, rollout_id: str) -> RemoteRollout | None:
        return await self.session.get(RemoteRollout, rollout_id, populate_existing=True)

    async def claim(self, row: dict[str, Any]) -> bool:
        """Insert a new running rollout; False when the rollout id is already known (a repeated init)."""
        dialect = self.session.get_bind().dialect.name
        insert: Any = postgresql.insert if dialect == "postgresql" else sqlite.insert
        result = await self.session.execute(
            insert(RemoteRollout)
            .values(**row)
            .on_conflict_do_nothing(index_elements=[RemoteRollout.rollout_id])
            .returning(RemoteRollout.rollout_id)
        )
        return result.scalar_one_or_none() is not None

    async def retry(self, previous: RemoteRollout, row: dict[str, Any]) -> bool:
        """Start the next attempt of a rollout whose last attempt failed, if `previous` (as read) is still
        its row: of concurrent retries exactly one wins. The failed attempt joins `earlier`."""
        ended = {
            "attempt": previous.attempt,
            "trace_id": previous.trace_id,
            "state": previous.status,
            "reason": previous.reason,
            "status_code": (previous.summary or {}).get("status_code"),
            "created_at": previous.created_at.isoformat(),
            "finished_at": previous.finished_at.isoformat() if previous.finished_at else None,
        }
        result = await self.session.execute(
            update(RemoteRollout)
            .where(
                RemoteRollout.rollout_id == previous.rollout_id,
                RemoteRollout.attempt == previous.attempt,
                RemoteRollout.status == "error",
            )
            .values(
                **row,
                attempt=previous.attempt + 1,
                earlier=[*(previous.earlier or []), ended],
                reason=None,
                reward=None,
                grader=None,
                finished_at=None,
            )
            .returning(RemoteRollout.rollout_id)
        )
        return result.scalar_one_or_none() is not None

    async def finish(
        self,
        rollout_id: str,
        *,
        attempt: int,
        worker: str,
        status: str,
        reason: str | None,
        reward: float | None,
        grader: str | None,
        summary: dict[str, Any],
        at: datetime,
    ) -> bool:
        """Record the outcome, only while the attempt is still this worker's running one."""
        result = await self.session.execute(
            update(RemoteRollout)
            .where(
                RemoteRollout.rollout_id == rollout_id,
                RemoteRollout.attempt == attempt,
                RemoteRollout.worker == worker,
                RemoteRollout.status == "running",
            )
            .values(
                status=status,
                reason=reason,
                reward=reward,
                grader=grader,
                summary=summary,
                finished_at=at,
            )
            .returning(RemoteRollout.rollout_id)
        )
        return result.scalar_one_or_none() is not None

    async def renew(self, worker: str, rollout_ids: Sequence[str], until: datetime) -> None:
        if rollout_ids:
            await self.session.execute(
                update(RemoteRollout)
                .where(
                    RemoteRollout.rollout_id.in_(rollout_ids),
                    RemoteRollout.worker == worker,
                    RemoteRollout.status == "running",
                )
                .values(lease_until=until)
            )

    async def fail_lost(self, now: datetime, reason: str, rollout_id: str | None = None) -> int:
        """Mark running rollouts whose lease lapsed (their worker died or restarted) as errors."""
        statement = update(RemoteRollout).where(
            RemoteRollout.status == "running", RemoteRollout.lease_until < now
        )
        if rollout_id is not None:
            statement = statement.where(RemoteRollout.rollout_id == rollout_id)
        result = await self.session.execute(
            statement.values(status="error", reason=reason, finished_at=now).returning(
                RemoteRollout.rollout_id
            )
        )
        return len(result.all())

    async def fail_worker(self, worker: str, rollout_ids: Sequence[str], reason: str, now: datetime) -> None:
        """A worker stopping marks the rollouts it was running as errors."""
        if rollout_ids:
            await self.session.execute(
                update(RemoteRollout)
                .where(
                    RemoteRollout.rollout_id.in_(rollout_ids),
                    RemoteRollout.worker == worker,
                    RemoteRollout.status == "running",
                )
                .values(status="error", reason=reason, finished_at=now)
            )

    async def running(self, worker: str) -> Sequence[str]:
        result = await self.session.scalars(
            select(RemoteRollout.rollout_id).where(
                RemoteRollout.worker == worker, RemoteRollout.status == "running"
            )
        )
        return result.all()
