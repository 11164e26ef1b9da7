"""The call log's day partitions on Postgres (app/db/partitions.py, migration 0010); SQLite unchanged."""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, func, inspect, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from typer.testing import CliRunner

from app.calls.log_writer import CallLogWriter, CallRecord
from app.cli import cli
from app.config import get_settings
from app.db import partitions
from app.db.migrate import downgrade, upgrade
from app.db.models import Grade, RolloutRow, ToolCall
from app.db.session import build_sessionmaker
from app.metrics import Metrics
from app.retention.service import make_partitions
from app.review.stats_repository import StatsRepository
from app.rollouts.timeline import read_timeline
from tests.conftest import create_pg_database, drop_pg_database

NOW = datetime.now(UTC)
TODAY = NOW.date()


@pytest.fixture(autouse=True)
def _today() -> None:
    """NOW and TODAY as each test starts: taken once at import, a run crossing midnight UTC (a suite
    started at 23:59) compared yesterday's partitions with those migrate made for today."""
    global NOW, TODAY
    NOW = datetime.now(UTC)
    TODAY = NOW.date()


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    """A Postgres database of its own, not yet migrated."""
    name = f"sparring_parts_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = await create_pg_database(name)
    try:
        yield url
    finally:
        await drop_pg_database(name)


async def on(url: str, fn: Any, *args: Any) -> Any:
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            return await conn.run_sync(fn, *args)
    finally:
        await engine.dispose()


def children(conn: Connection) -> dict[str, str]:
    """The partitions of tool_calls from the catalog (pg_inherits): name -> bounds."""
    rows = conn.execute(
        text(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = CAST('tool_calls' AS regclass)"
        )
    )
    return {name: bound for name, bound in rows}


def where_rows_are(conn: Connection) -> dict[int, str]:
    """id -> the partition that holds the row."""
    rows = conn.execute(text("SELECT id, CAST(tableoid AS regclass) FROM tool_calls"))
    return {int(i): str(t) for i, t in rows}


def ago(days: float) -> datetime:
    return NOW - timedelta(days=days)


def call(trace: str, call_id: str | None, at: datetime, outcome: str = "ok", run: str = "r") -> ToolCall:
    return ToolCall(
        trace_id=trace, call_id=call_id, tool="echo", arguments="{}", output=f"out {call_id}",
        outcome=outcome,
        error=None if outcome in ("ok", "replayed") else "failed", status_code=200, started_at=at,
        ended_at=at + timedelta(milliseconds=5), latency_ms=5.0, worker="w", run=run,
        output_bytes=len(f"out {call_id}"),
    )  # fmt: skip


def rollout(trace: str, calls: list[ToolCall], *, calls_read: int, graded: datetime | None) -> RolloutRow:
    return RolloutRow(
        trace_id=trace, run="r", first_seen=min(c.started_at for c in calls),
        last_seen=max(c.ended_at for c in calls), graded_at=graded, calls=calls_read,
    )  # fmt: skip


async def insert(url: str, rows: list[Any]) -> None:
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with build_sessionmaker(engine)() as session, session.begin():
            session.add_all(rows)
    finally:
        await engine.dispose()


async def timelines(url: str, traces: list[str]) -> dict[str, Any]:
    """The rollouts' timelines as the routes read them, and the run's call statistics."""
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with build_sessionmaker(engine)() as session:
            read = {}
            for trace in traces:
                detail = await read_timeline(session, trace)
                read[trace] = detail.model_dump(mode="json") if detail is not None else None
            tools, overall = await StatsRepository(session).call_stats("r")
            read["stats"] = (repr(tools), repr(overall))
            return read
    finally:
        await engine.dispose()


def seeded() -> tuple[list[Any], list[str]]:
    """Rollouts across several days: retries, a replay, a failure, one still graded recently."""
    rows: list[Any] = []
    traces = []
    for n, days in enumerate((45, 41, 40, 40.2, 2, 0.01)):
        trace = f"t{n}-{uuid.uuid4().hex[:6]}"
        start = ago(days)
        calls = [
            call(trace, "c0", start),
            call(trace, "c1", start + timedelta(seconds=1)),
            call(trace, "c1", start + timedelta(seconds=2), "replayed"),  # a retry the ledger answered
            call(trace, "c2", start + timedelta(seconds=3), "tool_crash"),
            call(trace, "c2", start + timedelta(seconds=4)),
            call(trace, None, start + timedelta(seconds=5)),
        ]
        # t3 was graded two days ago: it is still in use and stays whole through a 30-day prune.
        graded = ago(2) if n == 3 else start + timedelta(seconds=6)
        # As read: c0, c1 (its replay is not another call), c2's crash and its answer, the call
        # without an id.
        rows += [rollout(trace, calls, calls_read=5, graded=graded), *calls]
        rows.append(
            Grade(trace_id=trace, grader="g", grader_version="1", status="ok", score=1.0, run="r",
                  latency_ms=1.0, created_at=graded)
        )  # fmt: skip
        traces.append(trace)
    return rows, traces


# --- after migrate ---------------------------------------------------------------------------------


async def test_partitions_exist_after_migrate(pg_url: str) -> None:
    await asyncio.to_thread(upgrade, pg_url)
    found = await on(pg_url, children)
    ahead = {partitions.partition_name(TODAY + timedelta(days=n)) for n in range(partitions.AHEAD_DAYS)}
    assert set(found) == ahead | {partitions.DEFAULT_PARTITION}
    assert found[partitions.DEFAULT_PARTITION] == "DEFAULT"
    today = found[partitions.partition_name(TODAY)]
    assert today == f"FOR VALUES FROM ('{TODAY} 00:00:00+00') TO ('{TODAY + timedelta(days=1)} 00:00:00+00')"
    pk = await on(pg_url, lambda c: inspect(c).get_pk_constraint("tool_calls")["constrained_columns"])
    assert pk == ["id", "started_at"]  # a partitioned table's key holds its partition key
    # Upkeep finds nothing to make; a server starting tomorrow makes one more day.
    assert await on(pg_url, lambda c: partitions.ensure_partitions(c)) == []
    tomorrow = NOW + timedelta(days=1)
    made = await on(pg_url, lambda c: partitions.ensure_partitions(c, now=tomorrow))
    assert made == [partitions.partition_name(TODAY + timedelta(days=partitions.AHEAD_DAYS))]


# --- a call with no partition yet ------------------------------------------------------------------


def record(trace: str, call_id: str, at: datetime) -> CallRecord:
    return CallRecord(
        attempt_id=uuid.uuid4().hex, trace_id=trace, call_id=call_id, request_id=None, tool="echo",
        arguments="{}", output="far", outcome="ok", error=None, status_code=200, started_at=at,
        ended_at=at, latency_ms=1.0, worker="w", run="r", item_key=None,
    )  # fmt: skip


async def test_a_call_beyond_the_partitions_is_logged_then_moved_into_its_partition(pg_url: str) -> None:
    await asyncio.to_thread(upgrade, pg_url)
    far = NOW + timedelta(days=40)  # no partition is made that far ahead
    trace = f"far-{uuid.uuid4().hex[:6]}"
    engine = create_async_engine(pg_url)
    writer = CallLogWriter(engine, queue_size=10, batch_size=10, retry_after=1, metrics=Metrics())
    writer.start()
    try:
        await writer.write(record(trace, "c0", far))
        await writer.write(record(trace, "c0", far + timedelta(seconds=1)))  # its retry: not counted again
        async with engine.connect() as conn:
            held = await conn.run_sync(where_rows_are)
        assert set(held.values()) == {partitions.DEFAULT_PARTITION} and len(held) == 2
        before = await timelines(pg_url, [trace])
        assert len(before[trace]["timeline"]) == 1

        made = await make_partitions(engine)
        day = partitions.partition_name(far.date())
        assert made == [day]
        async with engine.connect() as conn:
            moved = await conn.run_sync(where_rows_are)
            stray = await conn.scalar(text(f"SELECT count(*) FROM {partitions.DEFAULT_PARTITION}"))
        assert moved == dict.fromkeys(held, day) and stray == 0
        assert await timelines(pg_url, [trace]) == before
        # The writer goes on logging into the new partition, and a void still finds its row there.
        later = record(trace, "c1", far + timedelta(seconds=2))
        await writer.write(later)
        await writer.void(later, reason="the answer was never sent")
        async with build_sessionmaker(engine)() as session:
            voided = await session.scalar(
                select(ToolCall.outcome).where(ToolCall.attempt_id == later.attempt_id)
            )
            counted = await session.scalar(select(RolloutRow.calls).where(RolloutRow.trace_id == trace))
        assert voided == "infra_error" and counted == 2
    finally:
        await writer.aclose()
        await engine.dispose()


# --- prune -----------------------------------------------------------------------------------------


def test_prune_drops_whole_partitions_and_the_rest_reads_as_before(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    asyncio.run(asyncio.to_thread(upgrade, pg_url))
    rows, traces = seeded()
    asyncio.run(insert(pg_url, rows))
    # The past days have no partitions yet: their calls are in the default partition until upkeep.
    held = asyncio.run(on(pg_url, where_rows_are))
    assert list(held.values()).count(partitions.DEFAULT_PARTITION) == 5 * 6  # all but today's rollout
    old = (45, 41, 40, 40.2)
    days = {d: partitions.partition_name((NOW - timedelta(days=d)).date()) for d in (*old, 2)}
    before = asyncio.run(timelines(pg_url, traces))
    monkeypatch.setenv("SPARRING_DATABASE_URL", pg_url)
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path))
    monkeypatch.delenv("SPARRING_REDIS_URL", raising=False)
    get_settings.cache_clear()
    try:
        made = CliRunner().invoke(cli, ["db", "partitions"])
        assert made.exit_code == 0, made.output
        assert f"made {len(set(days.values()))} partitions" in made.stdout, made.stdout
        assert "0 calls in tool_calls_default" in made.stdout
        assert set(days.values()) <= set(asyncio.run(on(pg_url, children)))
        assert asyncio.run(timelines(pg_url, traces)) == before  # moved out of the default partition

        result = CliRunner().invoke(cli, ["prune", "--older-than", "30d"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    # t0, t1, t2 go (6 logged attempts each; t3's day stays with its calls); t3 (graded 2 days ago),
    # t4 and t5 stay.
    assert re.match(
        r"removed 3 rollouts, 18 calls, 3 grades, 0 transcripts, 0 labels, 0 kept states, 0 remote rollouts "
        r"older than",
        result.stdout,
    ), result.stdout
    # Every day partition before the cutoff was dropped (the catalog no longer has them) ...
    dropped = re.findall(r"dropped partition (\w+) \((\d+) calls\)", result.stderr)
    assert {name for name, _ in dropped} == {days[d] for d in old}
    assert sum(int(n) for _, n in dropped) == 18
    left = asyncio.run(on(pg_url, children))
    assert days[45] not in left and (days[41] not in left or days[41] == days[40.2])
    # ... but the day of t3 (still in use), replaced by a partition holding only its calls.
    held = asyncio.run(on(pg_url, where_rows_are))
    assert list(held.values()).count(days[40.2]) == 6
    assert days[2] in left and days[40.2] in left
    after = asyncio.run(timelines(pg_url, traces))
    for n, trace in enumerate(traces):
        assert after[trace] == (None if n < 3 else before[trace]), trace
    # What stays counts as before: each rollout's stored count is its calls as read.
    counts = asyncio.run(on(pg_url, _stored_and_read))
    assert counts == {trace: (5, 5) for trace in traces[3:]}


def _stored_and_read(conn: Connection) -> dict[str, tuple[int, int]]:
    from app.db.call_log import stands

    stored = dict(conn.execute(select(RolloutRow.trace_id, RolloutRow.calls)).all())
    read = dict(
        conn.execute(
            select(ToolCall.trace_id, func.count()).where(stands()).group_by(ToolCall.trace_id)
        ).all()
    )
    return {trace: (int(stored[trace]), int(read.get(trace, 0))) for trace in stored}


# --- the migration moves the rows, and back --------------------------------------------------------


async def test_0010_moves_the_rows_and_back_reading_identically(pg_url: str) -> None:
    await asyncio.to_thread(upgrade, pg_url, "0009_transcripts")
    rows, traces = seeded()
    await insert(pg_url, rows)
    before = await timelines(pg_url, traces)
    ids = await on(pg_url, lambda c: sorted(c.execute(text("SELECT id FROM tool_calls")).scalars()))

    await asyncio.to_thread(upgrade, pg_url, "0010_partitioned_call_log")
    assert await timelines(pg_url, traces) == before
    held = await on(pg_url, where_rows_are)
    assert sorted(held) == ids
    assert partitions.DEFAULT_PARTITION not in held.values()  # every day the log held got its partition
    expected = {partitions.partition_name(r.started_at.date()) for r in rows if isinstance(r, ToolCall)}
    assert set(held.values()) == expected
    # Ids go on from the same sequence.
    await insert(pg_url, [call("new", "c0", NOW, run="another")])
    new_id = await on(
        pg_url, lambda c: c.execute(text("SELECT id FROM tool_calls WHERE trace_id='new'")).scalar()
    )
    assert new_id > max(ids)

    await asyncio.to_thread(downgrade, pg_url, "0009_transcripts")
    assert await timelines(pg_url, traces) == before
    assert await on(pg_url, partitions.is_partitioned) is False
    assert await on(pg_url, children) == {}
    pk = await on(pg_url, lambda c: inspect(c).get_pk_constraint("tool_calls")["constrained_columns"])
    assert pk == ["id"]
    assert sorted(await on(pg_url, where_rows_are)) == [*ids, new_id]


# --- SQLite ----------------------------------------------------------------------------------------


async def test_sqlite_keeps_one_table(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'sparring.db'}"
    await asyncio.to_thread(upgrade, url, "0009_transcripts")
    at_0009 = await on(url, _sqlite_schema)
    await asyncio.to_thread(upgrade, url)
    at_head = await on(url, _sqlite_schema)
    # One table as before; only the indexes led by trace_id change, as on Postgres: the call index
    # gains started_at and (trace_id, started_at) goes.
    tables = [row for row in at_head if row[0] == "table"]
    assert tables == [row for row in at_0009 if row[0] == "table"] and len(tables) == 1
    changed = {"ix_tool_calls_trace_call", "ix_tool_calls_trace_started"}
    assert [r for r in at_head if r[1] not in changed] == [r for r in at_0009 if r[1] not in changed]
    indexes = {r[1]: r[2] for r in at_head if r[0] == "index"}
    assert "ix_tool_calls_trace_started" not in indexes
    assert indexes["ix_tool_calls_trace_call"].endswith("(trace_id, call_id, started_at)")
    engine: AsyncEngine = create_async_engine(url, poolclass=NullPool)
    try:
        assert await make_partitions(engine) == []
        async with engine.connect() as conn:
            assert await conn.run_sync(partitions.partitions) == []
            assert await conn.run_sync(partitions.droppable, NOW) == []
    finally:
        await engine.dispose()


def _sqlite_schema(conn: Connection) -> list[Any]:
    return list(conn.execute(text("SELECT type, name, sql FROM sqlite_master WHERE tbl_name = 'tool_calls'")))


# --- the writer's plan -------------------------------------------------------------------------------


async def test_the_writers_probe_reads_its_index_after_the_log_grew_from_empty(pg_url: str) -> None:
    """The writer's statement is prepared once per connection, and Postgres keeps a generic plan for it
    made from the first batches. Planned while the day's partition was empty (no statistics yet, and none
    ever where autovacuum is off), that plan read the earlier answer of every call with a scan of the
    whole partition: a cost growing with the log (bench.tenk: 33,063 scans read 599M rows; 400 calls/s).
    Each batch must probe the call index, and read its own rollouts' rows, however the plan was made."""
    await asyncio.to_thread(upgrade, pg_url)
    engine = create_async_engine(pg_url)
    writer = CallLogWriter(engine, queue_size=10, batch_size=10, retry_after=1, metrics=Metrics())
    writer.start()
    trace = f"probe-{uuid.uuid4().hex[:6]}"
    grown = 20_000
    try:
        for n in range(10):  # while the log is empty: Postgres settles on a plan for the statement
            await writer.write(record(trace, f"c{n}", datetime.now(UTC)))
        async with engine.begin() as conn:  # other rollouts' calls of the same day
            await conn.execute(
                text(
                    "INSERT INTO tool_calls (attempt_id, trace_id, call_id, tool, arguments, output,"
                    " output_bytes, outcome, status_code, started_at, ended_at, latency_ms, worker, run,"
                    " channel) SELECT 'a' || g, 'other-' || (g % 500), 'call-' || g, 'echo', '{}', 'x', 1,"
                    " 'ok', 200, now(), now(), 1.0, 'w', 'r', 'model' FROM generate_series(1, :n) AS g"
                ),
                {"n": grown},
            )
            await conn.execute(
                text(
                    "INSERT INTO rollouts (trace_id, run, first_seen, last_seen, calls) SELECT 'other-' || g,"
                    " 'r', now(), now(), 1 FROM generate_series(1, :n) AS g"
                ),
                {"n": grown // 4},
            )
        for n in range(20):  # each probes for an earlier answer of its call
            await writer.write(record(trace, f"d{n}", datetime.now(UTC)))
            await writer.write(record(trace, f"d{n}", datetime.now(UTC)))  # a retry: answered before
    finally:
        await writer.aclose()
        await engine.dispose()  # the writer's backend ends, and reports its table statistics
    engine = create_async_engine(pg_url, poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            for _ in range(100):
                others = await conn.scalar(
                    text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                         " AND pid <> pg_backend_pid()")
                )  # fmt: skip
                if others == 0:
                    break
                await asyncio.sleep(0.05)
                await conn.execute(text("SELECT pg_stat_clear_snapshot()"))
            await conn.execute(text("SELECT pg_stat_clear_snapshot()"))
            read = await conn.scalar(
                text(
                    "SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables"
                    " WHERE relname LIKE 'tool_calls_p%' OR relname = 'tool_calls_default'"
                )
            )
            rollouts_read = await conn.scalar(
                text(
                    "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables"
                    " WHERE relname = 'rollouts'"
                )
            )
            counted = await conn.scalar(select(RolloutRow.calls).where(RolloutRow.trace_id == trace))
    finally:
        await engine.dispose()
    assert counted == 30  # the retries were found as answered before: not counted again
    assert read < grown, f"the writer scanned {read} rows of the log to probe 40 calls"
    # Each batch reads its own rollouts' rows by their key, not every rollout's (50 batches here).
    assert rollouts_read < grown // 4, f"the writer read {rollouts_read} rows of rollouts for 50 batches"
