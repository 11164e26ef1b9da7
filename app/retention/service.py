"""`sparring prune`: old rollouts, their calls and grades removed batch by batch, each batch its own
short transaction, so the server keeps logging and grading meanwhile (no long lock, no huge WAL).
Grades posted without a trace, remote rollouts (app/remote), and conversations and labels of a trace
that has no rollout row belong to no rollout: they go by their own dates, in batches too.

On Postgres the call log is partitioned by day (app/db/partitions.py): the prune first makes the
partitions (so calls of days that had none leave the default partition), deletes the old rollouts in
batches with their grades and the calls of the day straddling the cutoff, then drops every day
partition that lies entirely before the cutoff, keeping the calls of the rollouts that stay. Here too
the server keeps its partitions made ahead (`keep_partitions`)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import partitions
from app.db.session import build_sessionmaker
from app.errors import OUTAGES
from app.retention.repository import Removed, RetentionRepository

log = logging.getLogger(__name__)

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGE = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")


def parse_age(text: str) -> timedelta:
    """`30d`, `12h`, `90m`, `2w`, `45s` → a timedelta; anything else is a ValueError."""
    match = _AGE.match(text.lower())
    if match is None:
        raise ValueError(f"{text!r} is not an age like 30d, 12h, 90m, 2w")
    seconds = int(match.group(1)) * _UNITS[match.group(2)]
    if seconds <= 0:
        raise ValueError(f"{text!r}: the age must be above zero")
    try:
        return timedelta(seconds=seconds)
    except OverflowError as exc:
        raise ValueError(f"{text!r}: the age is too large") from exc


async def prune(
    engine: AsyncEngine,
    *,
    older_than: timedelta,
    run: str | None = None,
    batch_size: int = 500,
    dry_run: bool = False,
    now: datetime | None = None,
    on_batch: Callable[[Removed], None] | None = None,
    on_partition: Callable[[str, int], None] | None = None,
) -> Removed:
    """Remove (or, with dry_run, count) what is older than `older_than`; returns the totals.

    `on_batch` hears of each batch of rollouts; `on_partition` of each day partition dropped (its
    name, and the calls that went with it).
    """
    now = now or datetime.now(UTC)
    cutoff = now - older_than
    sessions = build_sessionmaker(engine)
    if dry_run:
        async with sessions() as session:
            return await RetentionRepository(session).count_old(cutoff, run)
    await make_partitions(engine, now=now)
    # Whole days go only when every rollout may go (with --run, the other runs' calls stay: rows).
    droppable: list[partitions.Partition] = []
    if run is None:
        async with engine.connect() as conn:
            droppable = await conn.run_sync(partitions.droppable, cutoff)
    partitions_before = droppable[-1].end if droppable else None
    total = Removed()

    def done(removed: Removed) -> None:
        nonlocal total
        total += removed
        if on_batch is not None and removed != Removed():
            on_batch(removed)

    while True:
        async with sessions() as session, session.begin():
            repository = RetentionRepository(session)
            trace_ids = await repository.old_trace_ids(cutoff, run, batch_size)
            removed = (
                await repository.delete_rollouts(trace_ids, cutoff, partitions_before=partitions_before)
                if trace_ids
                else Removed()
            )
        done(removed)
        # A short batch was the last; an empty one means every selected rollout came back to life.
        if len(trace_ids) < batch_size or removed.rollouts == 0:
            break
    while True:
        async with sessions() as session, session.begin():
            grades = await RetentionRepository(session).delete_traceless_grades(cutoff, run, batch_size)
        done(Removed(grades=grades))
        if grades < batch_size:
            break
    while True:
        async with sessions() as session, session.begin():
            remote = await RetentionRepository(session).delete_remote_rollouts(cutoff, run, batch_size)
        done(Removed(remote_rollouts=remote))
        if remote < batch_size:
            break
    while run is None:  # a conversation or a label of no rollout has no run
        async with sessions() as session, session.begin():
            strays = await RetentionRepository(session).delete_strays(cutoff, batch_size)
        done(strays)
        if max(strays.transcripts, strays.labels) < batch_size:
            break
    for part in droppable:
        calls = await _drop_partition(engine, part)
        if calls is not None:
            total += Removed(calls=calls)
            if on_partition is not None:
                on_partition(part.name, calls)
    return total


_DROP_TRIES = 3


async def _drop_partition(engine: AsyncEngine, part: partitions.Partition) -> int | None:
    """Drop one old day partition (its calls that stay are kept); the calls that went, or None when it
    could not get its locks in three tries (a long query on the log): the next prune drops it."""
    async with engine.connect() as conn:
        rows = await conn.run_sync(partitions.count_rows, part)
    for attempt in range(_DROP_TRIES):
        try:
            async with engine.begin() as conn:
                kept = await conn.run_sync(partitions.drop_partition, part)
            return rows - kept
        except DBAPIError as exc:
            if not _lock_timeout(exc):
                raise
            log.warning("prune: %s is busy (try %d of %d): %s", part.name, attempt + 1, _DROP_TRIES, exc)
            await asyncio.sleep(1.0)
    log.warning("prune: %s kept for the next prune (its locks were never free)", part.name)
    return None


def _lock_timeout(exc: DBAPIError) -> bool:
    return getattr(exc.orig, "sqlstate", None) == "55P03" or "lock timeout" in str(exc)


async def make_partitions(engine: AsyncEngine, *, now: datetime | None = None) -> list[str]:
    """Make the call log's partitions ahead (and of the days the default partition holds calls of);
    the names made. A no-op on SQLite. Waits for a lock one second at most, then leaves it for the
    next round (a warning; the calls meanwhile go to the default partition, never fail)."""
    if engine.dialect.name != "postgresql":
        return []
    try:
        async with engine.begin() as conn:
            made: list[str] = await conn.run_sync(lambda sync: partitions.ensure_partitions(sync, now=now))
    except DBAPIError as exc:
        if not _lock_timeout(exc):
            raise
        log.warning("call log: partitions not made this round (a lock was busy): %s", exc)
        return []
    if made:
        log.info("call log: partitions made: %s", ", ".join(made))
    return made


async def upkeep_round(engine: AsyncEngine) -> None:
    """One round of the server's upkeep: a database outage skips it with a warning."""
    try:
        await make_partitions(engine)
    except OUTAGES as exc:
        log.warning("call log: partition upkeep failed this round: %s", exc)


async def keep_partitions(engine: AsyncEngine, *, interval: float = partitions.MAINTENANCE_SECONDS) -> None:
    """The server's upkeep of the call log's partitions (after the round at start-up): a round every
    `interval` seconds until cancelled."""
    while True:
        await asyncio.sleep(interval)
        await upkeep_round(engine)
