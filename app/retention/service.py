"""`sparring prune`: old rollouts, their calls and grades removed batch by batch, each batch its own
short transaction, so the server keeps logging and grading meanwhile (no long lock, no huge WAL)."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from app.db.session import build_sessionmaker
from app.retention.repository import Removed, RetentionRepository

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
    return timedelta(seconds=seconds)


async def prune(
    engine: AsyncEngine,
    *,
    older_than: timedelta,
    run: str | None = None,
    batch_size: int = 500,
    dry_run: bool = False,
    now: datetime | None = None,
    on_batch: Callable[[Removed], None] | None = None,
) -> Removed:
    """Remove (or, with dry_run, count) what is older than `older_than`; returns the totals."""
    cutoff = (now or datetime.now(UTC)) - older_than
    sessions = build_sessionmaker(engine)
    if dry_run:
        async with sessions() as session:
            return await RetentionRepository(session).count_old(cutoff, run)
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
            removed = await repository.delete_rollouts(trace_ids, cutoff) if trace_ids else Removed()
        done(removed)
        # A short batch was the last; an empty one means every selected rollout came back to life.
        if len(trace_ids) < batch_size or removed.rollouts == 0:
            break
    while True:
        async with sessions() as session, session.begin():
            grades = await RetentionRepository(session).delete_traceless_grades(cutoff, run, batch_size)
        done(Removed(grades=grades))
        if grades < batch_size:
            return total
