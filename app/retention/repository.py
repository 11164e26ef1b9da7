"""Every query of `sparring prune`: find old rollouts, count them, delete one batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, column, delete, exists, func, or_, select, table
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Grade, KeptState, RemoteRollout, RolloutLabel, RolloutRow, ToolCall, TranscriptRow
from app.db.partitions import DEFAULT_PARTITION

# The call log's default partition (Postgres, app/db/partitions.py): calls of days without a partition.
_default_partition = table(DEFAULT_PARTITION, column("trace_id"), column("started_at"))


@dataclass(frozen=True)
class Removed:
    """What a prune removed (or, dry, would remove), by kind."""

    rollouts: int = 0
    calls: int = 0
    grades: int = 0
    transcripts: int = 0
    labels: int = 0
    kept_states: int = 0
    remote_rollouts: int = 0

    def __add__(self, other: Removed) -> Removed:
        return Removed(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def _old_rollout(cutoff: datetime, run: str | None) -> ColumnElement[bool]:
    """A rollout is old when nothing happened to it since the cutoff: no call, no grade."""
    condition = and_(
        RolloutRow.last_seen < cutoff, or_(RolloutRow.graded_at.is_(None), RolloutRow.graded_at < cutoff)
    )
    return and_(condition, RolloutRow.run == run) if run is not None else condition


def _old_traceless_grade(cutoff: datetime, run: str | None) -> ColumnElement[bool]:
    """Grades posted without a trace_id belong to no rollout: they age by their own date."""
    condition = and_(Grade.trace_id.is_(None), Grade.created_at < cutoff)
    return and_(condition, Grade.run == run) if run is not None else condition


def _old_remote_rollout(cutoff: datetime, run: str | None) -> ColumnElement[bool]:
    """A remote rollout (`POST /remote/init`, with its init request) ages by its own dates: one that
    ended, by its end (its start if it has none); one still running only once its lease lapsed before
    the cutoff (its worker is long dead: a live one renews the lease every few seconds)."""
    ended = and_(
        RemoteRollout.status.in_(("finished", "error")),
        or_(
            RemoteRollout.finished_at < cutoff,
            and_(RemoteRollout.finished_at.is_(None), RemoteRollout.created_at < cutoff),
        ),
    )
    lost = and_(RemoteRollout.status == "running", RemoteRollout.lease_until < cutoff)
    condition = or_(ended, lost)
    return and_(condition, RemoteRollout.run == run) if run is not None else condition


# What may outlive its rollout row, with the date it ages by: a conversation stored before any call (or
# for a trace that never logged one), a label set while its rollout was being pruned.
Stray = type[TranscriptRow] | type[RolloutLabel]
_AGED_BY: dict[Stray, Any] = {TranscriptRow: TranscriptRow.stored_at, RolloutLabel: RolloutLabel.labelled_at}


def _old_stray(kind: Stray, cutoff: datetime) -> ColumnElement[bool]:
    """A row of no rollout ages by its own date; it has no run, so only a prune without --run takes it."""
    return and_(_AGED_BY[kind] < cutoff, ~exists().where(RolloutRow.trace_id == kind.trace_id))


class RetentionRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def old_trace_ids(self, cutoff: datetime, run: str | None, limit: int) -> Sequence[str]:
        """The oldest `limit` old rollouts (the index on last_seen finds them)."""
        query = (
            select(RolloutRow.trace_id)
            .where(_old_rollout(cutoff, run))
            .order_by(RolloutRow.last_seen)
            .limit(limit)
        )
        return (await self.session.scalars(query)).all()

    async def delete_rollouts(
        self, trace_ids: Sequence[str], cutoff: datetime, *, partitions_before: datetime | None = None
    ) -> Removed:
        """Delete these rollouts if they are still old, then their calls and grades.

        The rollout rows go first, with the age rechecked: a rollout that got a call since it was
        selected stays whole, and a call being logged for a rollout deleted here waits on its row
        and then starts a new one. Calls and grades are deleted by trace (their index) and date,
        so nothing logged after the cutoff goes.

        With `partitions_before` (Postgres, a partitioned log), the calls before it lie in day
        partitions the prune drops whole afterwards (app/db/partitions.py): only the calls from it to
        the cutoff are deleted here, and those before it in the default partition.
        """
        deleted = (
            await self.session.scalars(
                delete(RolloutRow)
                .where(RolloutRow.trace_id.in_(trace_ids), _old_rollout(cutoff, None))
                .returning(RolloutRow.trace_id)
                .execution_options(synchronize_session=False)
            )
        ).all()
        if not deleted:
            return Removed()
        since = [ToolCall.started_at >= partitions_before] if partitions_before is not None else []
        calls = await self.session.execute(
            delete(ToolCall)
            .where(ToolCall.trace_id.in_(deleted), ToolCall.started_at < cutoff, *since)
            .execution_options(synchronize_session=False)
        )
        calls_removed = _rowcount(calls)
        if partitions_before is not None:
            stray = await self.session.execute(
                delete(_default_partition).where(
                    _default_partition.c.trace_id.in_(deleted),
                    _default_partition.c.started_at < partitions_before,
                )
            )
            calls_removed += _rowcount(stray)
        grades = await self.session.execute(
            delete(Grade)
            .where(Grade.trace_id.in_(deleted), Grade.created_at < cutoff)
            .execution_options(synchronize_session=False)
        )
        # What belongs to the rollout alone goes with it: its kept state, its label, its conversation.
        alone = {}
        for kept in (KeptState, RolloutLabel, TranscriptRow):
            alone[kept] = _rowcount(
                await self.session.execute(
                    delete(kept)
                    .where(kept.trace_id.in_(deleted))
                    .execution_options(synchronize_session=False)
                )
            )
        return Removed(
            len(deleted),
            calls_removed,
            _rowcount(grades),
            transcripts=alone[TranscriptRow],
            labels=alone[RolloutLabel],
            kept_states=alone[KeptState],
        )

    async def delete_traceless_grades(self, cutoff: datetime, run: str | None, limit: int) -> int:
        ids = select(Grade.id).where(_old_traceless_grade(cutoff, run)).order_by(Grade.id).limit(limit)
        result = await self.session.execute(
            delete(Grade)
            .where(Grade.id.in_(ids.scalar_subquery()))
            .execution_options(synchronize_session=False)
        )
        return _rowcount(result)

    async def delete_remote_rollouts(self, cutoff: datetime, run: str | None, limit: int) -> int:
        """Delete up to `limit` old remote rollouts; one retried meanwhile (running again, on a fresh
        lease) stays."""
        return await self._delete_old(
            RemoteRollout, RemoteRollout.rollout_id, _old_remote_rollout(cutoff, run), limit
        )

    async def delete_strays(self, cutoff: datetime, limit: int) -> Removed:
        """Delete up to `limit` old conversations and as many old labels of no rollout; one stored again
        meanwhile stays."""
        return Removed(
            transcripts=await self._delete_old(
                TranscriptRow, TranscriptRow.trace_id, _old_stray(TranscriptRow, cutoff), limit
            ),
            labels=await self._delete_old(
                RolloutLabel, RolloutLabel.trace_id, _old_stray(RolloutLabel, cutoff), limit
            ),
        )

    async def _delete_old(self, kind: Any, key: Any, old: ColumnElement[bool], limit: int) -> int:
        """Delete up to `limit` rows of `kind` that are `old`, the age checked again on the row deleted
        (it may have changed since the row was picked)."""
        ids = select(key).where(old).limit(limit)
        result = await self.session.execute(
            delete(kind)
            .where(key.in_(ids.scalar_subquery()), old)
            .execution_options(synchronize_session=False)
        )
        return _rowcount(result)

    async def count_old(self, cutoff: datetime, run: str | None) -> Removed:
        """What a prune with these arguments would remove now (for --dry-run)."""
        old = select(RolloutRow.trace_id).where(_old_rollout(cutoff, run))

        def alone(kind: Stray) -> ColumnElement[bool]:
            of_old = kind.trace_id.in_(old)
            return or_(of_old, _old_stray(kind, cutoff)) if run is None else of_old

        return Removed(
            rollouts=await self._count(old.subquery()),
            calls=await self._count(ToolCall, ToolCall.trace_id.in_(old), ToolCall.started_at < cutoff),
            grades=await self._count(
                Grade,
                or_(
                    and_(Grade.trace_id.in_(old), Grade.created_at < cutoff),
                    _old_traceless_grade(cutoff, run),
                ),
            ),
            transcripts=await self._count(TranscriptRow, alone(TranscriptRow)),
            labels=await self._count(RolloutLabel, alone(RolloutLabel)),
            kept_states=await self._count(KeptState, KeptState.trace_id.in_(old)),
            remote_rollouts=await self._count(RemoteRollout, _old_remote_rollout(cutoff, run)),
        )

    async def _count(self, source: Any, *where: ColumnElement[bool]) -> int:
        return int(await self.session.scalar(select(func.count()).select_from(source).where(*where)) or 0)


def _rowcount(result: object) -> int:
    count = getattr(result, "rowcount", 0)
    return int(count) if count is not None and count >= 0 else 0
