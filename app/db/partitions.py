"""The call log's partitions on Postgres: `tool_calls` is range-partitioned by `started_at`, one
partition per UTC day, so `sparring prune` drops whole days instead of deleting rows one by one.

- A partition per day is made ahead (`AHEAD_DAYS`) by the migration (0010), by the server (at start-up
  and then every `MAINTENANCE_SECONDS`) and by `sparring db partitions`.
- A call whose day has no partition yet lands in the DEFAULT partition (`tool_calls_default`): logging
  never waits on, or fails for, a missing partition (create-on-demand would put DDL, its locks and its
  failures on the write path). Maintenance keeps the default partition empty: a day it holds rows of
  gets its partition, and its rows move there in the same transaction.
- Partitions are named by their day (`tool_calls_p20261206`); only those are managed here.
- Every change of partitions takes one advisory lock (replicas and `sparring db` run it at once) and a
  short lock timeout, so it waits behind a long query for seconds at most, never stalls the log writer
  queued behind it, and is retried at the next round.

SQLite keeps one plain table: every function here is a no-op on it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import Connection, text

log = logging.getLogger(__name__)

TABLE = "tool_calls"
DEFAULT_PARTITION = "tool_calls_default"
AHEAD_DAYS = 7  # partitions made ahead, today included
MAINTENANCE_SECONDS = 3600.0  # how often a server makes the partitions ahead
LOCK_TIMEOUT = "1s"  # the longest a change of partitions waits for a lock (then: the next round)
# Arbitrary constant: one change of the partitions at a time, across servers and `sparring db`.
PARTITIONS_LOCK_ID = 0x5BA7_9A87
_NAME = re.compile(r"^tool_calls_p(\d{8})$")


@dataclass(frozen=True, order=True)
class Partition:
    day: date

    @property
    def name(self) -> str:
        return partition_name(self.day)

    @property
    def start(self) -> datetime:
        return day_start(self.day)

    @property
    def end(self) -> datetime:
        return day_start(self.day + timedelta(days=1))


def partition_name(day: date) -> str:
    return f"tool_calls_p{day:%Y%m%d}"


def day_start(day: date) -> datetime:
    return datetime.combine(day, time(), tzinfo=UTC)


def _literal(moment: datetime) -> str:
    """A timestamptz literal in UTC (for DDL, which takes no parameters)."""
    return f"'{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S}+00'"


def is_partitioned(conn: Connection) -> bool:
    """Whether the call log is partitioned here (Postgres at revision 0010 or later)."""
    if conn.dialect.name != "postgresql":
        return False
    found = conn.execute(
        text(
            "SELECT 1 FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid "
            "WHERE c.relname = :table AND c.relnamespace = to_regnamespace(current_schema())"
        ),
        {"table": TABLE},
    ).first()
    return found is not None


def partitions(conn: Connection) -> list[Partition]:
    """The day partitions of the call log, oldest first (not the default partition)."""
    if not is_partitioned(conn):
        return []
    names = conn.execute(
        text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = CAST(:table AS regclass)"
        ),
        {"table": TABLE},
    ).scalars()
    days = []
    for name in names:
        match = _NAME.match(name)
        if match is not None:
            days.append(Partition(datetime.strptime(match.group(1), "%Y%m%d").date()))
    return sorted(days)


def _lock(conn: Connection) -> None:
    """In the current transaction: the partitions' advisory lock, and a bounded wait for table locks."""
    conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": PARTITIONS_LOCK_ID})


def _default_days(conn: Connection) -> list[date]:
    """The UTC days the default partition holds rows of (normally none)."""
    rows = conn.execute(
        text(
            f"SELECT DISTINCT CAST(date_trunc('day', started_at AT TIME ZONE 'UTC') AS date) "
            f"FROM {DEFAULT_PARTITION}"
        )
    ).scalars()
    return sorted(rows)


def create_partition(conn: Connection, day: date) -> bool:
    """Make the partition of `day` unless it exists, moving the day's rows out of the default partition;
    in the caller's transaction, under `_lock`. True when it was made.

    Made as a table of its own, then attached: ATTACH takes a lock on `tool_calls` that lets the log
    writer insert and the readers read meanwhile (CREATE ... PARTITION OF would block them).
    """
    part = Partition(day)
    exists = conn.execute(text("SELECT to_regclass(:name)"), {"name": part.name}).scalar()
    if exists is not None:
        return False
    start, end = _literal(part.start), _literal(part.end)
    conn.execute(text(f"CREATE TABLE {part.name} (LIKE {TABLE})"))
    moved = conn.execute(
        text(
            f"WITH moved AS (DELETE FROM {DEFAULT_PARTITION} "
            f"WHERE started_at >= {start} AND started_at < {end} RETURNING *) "
            f"INSERT INTO {part.name} SELECT * FROM moved"
        )
    ).rowcount
    conn.execute(
        text(f"ALTER TABLE {TABLE} ATTACH PARTITION {part.name} FOR VALUES FROM ({start}) TO ({end})")
    )
    if moved:
        log.info("call log: %d calls moved from the default partition into %s", moved, part.name)
    return True


def ensure_partitions(conn: Connection, *, now: datetime | None = None, ahead: int = AHEAD_DAYS) -> list[str]:
    """Make the partitions of today and the `ahead - 1` days after it, and of every day the default
    partition holds rows of; in one transaction the caller commits. The names made are returned."""
    if not is_partitioned(conn):
        return []
    _lock(conn)
    today = (now or datetime.now(UTC)).astimezone(UTC).date()
    days: set[date] = {today + timedelta(days=n) for n in range(ahead)}
    days.update(_default_days(conn))
    return [partition_name(day) for day in sorted(days) if create_partition(conn, day)]


def create_days(conn: Connection, days: Iterable[date]) -> None:
    """Make the partitions of these days (the migration: the days the log already holds)."""
    for day in sorted(set(days)):
        create_partition(conn, day)


def droppable(conn: Connection, cutoff: datetime) -> list[Partition]:
    """The day partitions that lie entirely before `cutoff`."""
    return [part for part in partitions(conn) if part.end <= cutoff]


def is_partition_name(name: str) -> bool:
    """Whether a table is one of the call log's partitions (made at run time, not by the models)."""
    return name == DEFAULT_PARTITION or _NAME.match(name) is not None


def include_name(name: str | None, type_: str, _parent: object) -> bool:
    """Alembic's autogenerate leaves out the partitions (made at run time, not by the models)."""
    return not (type_ == "table" and name is not None and is_partition_name(name))


# A logged call its rollout still counts: the rollout's row exists and was there when the call was
# logged (a rollout deleted by a prune and started again by a new call has a later first_seen).
_COUNTED = (
    "EXISTS (SELECT 1 FROM rollouts r_ WHERE r_.trace_id = c_.trace_id AND r_.first_seen <= c_.started_at)"
)


def count_rows(conn: Connection, part: Partition) -> int:
    return int(conn.execute(text(f"SELECT count(*) FROM {part.name}")).scalar_one())


def drop_partition(conn: Connection, part: Partition) -> int:
    """Drop a partition that lies before the prune's cutoff, once the prune deleted its old rollouts;
    in the caller's transaction. The calls of a rollout that stays (one still in use, or of another
    run) stay too: they go into a new partition of the same day, which replaces it. Returns how many
    calls stayed.

    Only a void may still write into a day that old; the partition's SHARE lock holds it off while the
    calls that stay are copied.
    """
    _lock(conn)
    conn.execute(text(f"LOCK TABLE {part.name} IN SHARE MODE"))
    staying = f"{part.name}_staying"
    conn.execute(text(f"CREATE TABLE {staying} (LIKE {TABLE})"))
    kept = conn.execute(text(f"INSERT INTO {staying} SELECT * FROM {part.name} c_ WHERE {_COUNTED}")).rowcount
    conn.execute(text(f"DROP TABLE {part.name}"))
    if not kept:
        conn.execute(text(f"DROP TABLE {staying}"))
        return 0
    conn.execute(text(f"ALTER TABLE {staying} RENAME TO {part.name}"))
    start, end = _literal(part.start), _literal(part.end)
    conn.execute(
        text(f"ALTER TABLE {TABLE} ATTACH PARTITION {part.name} FOR VALUES FROM ({start}) TO ({end})")
    )
    return int(kept)
