"""The call log at 1M and 10M calls, one table (revision 0009) against day partitions (0010), on Postgres.

    python -m bench.partitions                       # 1,000,000 and 10,000,000 calls
    python -m bench.partitions --calls 1000000       # one size

For each size it makes a fresh database at revision 0009 and fills it in SQL (generate_series, no
HTTP): 100,000 calls a day (one run a day of 10,000 rollouts, 10 calls each, graded once), ending
yesterday, so 1M calls are 10 days and 10M are 100 days. After VACUUM (ANALYZE) it times, through the
functions the routes use, the rollout timeline (`RolloutReview.detail`, `GET /review/api/rollouts/{id}`)
of random rollouts of the whole log, and the run statistics (`RunStatistics.run_stats`,
`GET /review/api/stats?run=`) of the latest run and of the first one, with `call_stats` alone (the
query of the statistics that reads the call log). Then it migrates to 0010 (timed: the rows move), runs
VACUUM (ANALYZE) again and times the same reads on the same rows. Last, on the partitioned log, it
times `prune` of the oldest tenth of the days. The database is dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from app.db.migrate import upgrade
from app.db.session import build_sessionmaker
from app.retention.service import prune
from app.review.service import RolloutReview
from app.review.statistics import RunStatistics
from app.review.stats_repository import StatsRepository
from bench.run import DEFAULT_PG_ADMIN

CALLS_PER_ROLLOUT = 10
ROLLOUTS_PER_DAY = 10_000  # one run a day
TOOLS = (
    "ARRAY['get_order_details','get_user_details','modify_user_address','list_all_product_types','search']"
)
# The indexes of 0009 (dropped during the fill and built once, as a restore would: the same schema).
INDEXES_0009 = (
    "CREATE INDEX ix_tool_calls_outcome ON tool_calls (outcome)",
    "CREATE INDEX ix_tool_calls_run_tool_latency ON tool_calls (run, tool, latency_ms) "
    "INCLUDE (outcome, output_bytes)",
    "CREATE INDEX ix_tool_calls_tool_started ON tool_calls (tool, started_at)",
    "CREATE INDEX ix_tool_calls_trace_call ON tool_calls (trace_id, call_id)",
    "CREATE INDEX ix_tool_calls_trace_started ON tool_calls (trace_id, started_at)",
)


def _trace(r: str) -> str:
    return f"'t' || lpad(CAST({r} AS text), 9, '0')"


def fill_sql(calls: int, start: datetime) -> list[str]:
    rollouts = calls // CALLS_PER_ROLLOUT
    spacing = 86400.0 / ROLLOUTS_PER_DAY  # seconds between two rollouts' starts
    at = f"TIMESTAMPTZ '{start.isoformat()}'"
    rollout_start = f"{at} + make_interval(secs => r * {spacing})"
    call_start = (
        f"{at} + make_interval(secs => (i / {CALLS_PER_ROLLOUT}) * {spacing} + (i % {CALLS_PER_ROLLOUT}))"
    )
    run = f"'run' || lpad(CAST(%s / {ROLLOUTS_PER_DAY} AS text), 4, '0')"
    return [
        f"""INSERT INTO rollouts (trace_id, run, item_key, first_seen, last_seen, graded_at, channel, calls)
        SELECT {_trace("r")}, {run % "r"}, 'item' || (r % 1000), {rollout_start},
               {rollout_start} + interval '10 seconds', {rollout_start} + interval '11 seconds', 'rft',
               {CALLS_PER_ROLLOUT}
        FROM generate_series(0, {rollouts - 1}) AS r""",
        f"""INSERT INTO tool_calls (attempt_id, trace_id, call_id, tool, arguments, output, output_bytes,
            outcome, error, status_code, started_at, ended_at, latency_ms, worker, run, item_key, channel)
        SELECT md5(CAST(i AS text)), {_trace(f"i / {CALLS_PER_ROLLOUT}")}, 'c' || (i % {CALLS_PER_ROLLOUT}),
               ({TOOLS})[1 + (i * 7 + i / {CALLS_PER_ROLLOUT}) % 5], '{{"order_id": "#W0001"}}',
               'an answer of call ' || i, 20,
               CASE WHEN i % 23 = 0 THEN 'model_error' ELSE 'ok' END,
               CASE WHEN i % 23 = 0 THEN 'Error: no such order' END, 200,
               {call_start}, {call_start} + interval '40 milliseconds', 1 + (i * 37 % 997) / 10.0, 'w0',
               {run % f"(i / {CALLS_PER_ROLLOUT})"}, 'item' || ((i / {CALLS_PER_ROLLOUT}) % 1000), 'rft'
        FROM generate_series(0, {calls - 1}) AS i""",
        f"""INSERT INTO grades (trace_id, grader, grader_version, status, score, sub_scores, flags, errors,
            sample, answer_hash, item_key, run, latency_ms, created_at)
        SELECT {_trace("r")}, 'bench', '1', 'ok', (r % 11) / 10.0, '{{}}', '[]', '[]', '{{}}',
               md5(CAST(r % 5000 AS text)), 'item' || (r % 1000), {run % "r"}, 1.0,
               {rollout_start} + interval '11 seconds'
        FROM generate_series(0, {rollouts - 1}) AS r""",
    ]


async def fill(engine: AsyncEngine, calls: int, start: datetime) -> float:
    t0 = time.perf_counter()
    async with engine.begin() as conn:
        for name in ("outcome", "run_tool_latency", "tool_started", "trace_call", "trace_started"):
            await conn.execute(text(f"DROP INDEX ix_tool_calls_{name}"))
        for statement in fill_sql(calls, start):
            await conn.execute(text(statement))
        for statement in INDEXES_0009:
            await conn.execute(text(statement))
    await vacuum(engine)
    return time.perf_counter() - t0


async def vacuum(engine: AsyncEngine) -> None:
    # What autovacuum does to an insert-heavy table before long: statistics and a visibility map.
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("VACUUM (ANALYZE)"))


def _backend_cpu(pid: int) -> float | None:
    """CPU seconds a local Postgres backend used so far (the machine's load moves it less than wall
    time); None when Postgres is not on this machine."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ms(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {
        "p50": round(values[len(values) // 2] * 1000, 2),
        "p90": round(values[int(len(values) * 0.9)] * 1000, 2),
    }


async def measure(engine: AsyncEngine, calls: int, args: argparse.Namespace) -> dict[str, Any]:
    sessions = build_sessionmaker(engine)
    rollouts = calls // CALLS_PER_ROLLOUT
    runs = rollouts // ROLLOUTS_PER_DAY
    rng = random.Random(7)
    traces = [f"t{rng.randrange(rollouts):09d}" for _ in range(args.timelines)]
    result: dict[str, Any] = {}
    for trace in traces[:5]:  # warm the caches and the plans once, as a running server has them
        async with sessions() as session:
            await RolloutReview(session).detail(trace)
    timings = []
    for trace in traces:
        async with sessions() as session:
            t0 = time.perf_counter()
            detail = await RolloutReview(session).detail(trace)
            timings.append(time.perf_counter() - t0)
        assert len(detail.timeline) == CALLS_PER_ROLLOUT, (trace, len(detail.timeline))
    result["timeline_ms"] = _ms(timings)
    for label, run in (("latest_run", f"run{runs - 1:04d}"), ("first_run", "run0000")):
        totals = []
        for _ in range(args.repeats):
            async with sessions() as session:
                t0 = time.perf_counter()
                stats = await RunStatistics(session, sessions=sessions).run_stats(run)
                totals.append(time.perf_counter() - t0)
        assert stats.rollouts == ROLLOUTS_PER_DAY, stats.rollouts
        alone, cpu = [], []
        for _ in range(args.repeats):
            async with sessions() as session:
                pid = int(await session.scalar(text("SELECT pg_backend_pid()")) or 0)
                c0 = _backend_cpu(pid)
                t0 = time.perf_counter()
                await StatsRepository(session).call_stats(run)
                alone.append(time.perf_counter() - t0)
                c1 = _backend_cpu(pid)
                if c0 is not None and c1 is not None:
                    cpu.append(c1 - c0)
        result[label] = {
            "run_stats_ms": round(statistics.median(totals) * 1000, 1),
            "call_stats_ms": round(statistics.median(alone) * 1000, 1),
            "call_stats_cpu_ms": round(statistics.median(cpu) * 1000) if cpu else None,
        }
    return result


async def bench_size(admin_url: str, calls: int, args: argparse.Namespace) -> dict[str, Any]:
    name = f"sparring_bench_parts_{calls}"
    admin = create_async_engine(admin_url, isolation_level="AUTOCOMMIT")
    async with admin.connect() as conn:
        await conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        await conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = admin_url.rsplit("/", 1)[0] + f"/{name}"
    days = calls // CALLS_PER_ROLLOUT // ROLLOUTS_PER_DAY
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    start = today - timedelta(days=days)
    report: dict[str, Any] = {"calls": calls, "days": days}
    try:
        await asyncio.to_thread(upgrade, url, "0009_transcripts")
        engine = create_async_engine(url, pool_size=8)
        try:
            report["fill_s"] = round(await fill(engine, calls, start), 1)
            print(f"{calls:,} calls over {days} days filled in {report['fill_s']} s", flush=True)
            report["before"] = await measure(engine, calls, args)
            print(f"  0009 (one table): {json.dumps(report['before'])}", flush=True)
        finally:
            await engine.dispose()
        t0 = time.perf_counter()
        await asyncio.to_thread(upgrade, url, "0010_partitioned_call_log")
        report["migrate_s"] = round(time.perf_counter() - t0, 1)
        engine = create_async_engine(url, pool_size=8)
        try:
            await vacuum(engine)
            report["after"] = await measure(engine, calls, args)
            print(f"  migrated in {report['migrate_s']} s; 0010 (partitions): {json.dumps(report['after'])}")
            keep = days - max(1, days // 10)
            t0 = time.perf_counter()
            removed = await prune(engine, older_than=timedelta(days=keep), now=today, batch_size=5000)
            report["prune"] = {
                "days": days - keep,
                "calls": removed.calls,
                "rollouts": removed.rollouts,
                "s": round(time.perf_counter() - t0, 2),
            }
            print(f"  prune of the oldest {days - keep} days: {json.dumps(report['prune'])}", flush=True)
        finally:
            await engine.dispose()
    finally:
        async with admin.connect() as conn:
            await conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        await admin.dispose()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", default="1000000,10000000", help="sizes, comma-separated")
    parser.add_argument("--timelines", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN)
    parser.add_argument("--json", help="write the reports here")
    args = parser.parse_args(argv)
    reports = []
    for size in (int(n) for n in args.calls.split(",")):
        reports.append(asyncio.run(bench_size(args.pg_admin_url, size, args)))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(reports, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
