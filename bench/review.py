"""The review's query times at scale: one million logged calls, a run of 100,000 rollouts, on Postgres.

    python -m bench.review                          # 100,000 rollouts, about 1,000,000 calls
    python -m bench.review --rollouts 20000         # a quicker look

It seeds a fresh database (`app.review.seed`, COPY) with graded rollouts of 2 to 18 calls each (10 on
average) in one run, runs VACUUM (ANALYZE) as autovacuum would, then times through RolloutReview and
RunStatistics, as the API does: the rollout timeline (`GET /review/api/rollouts/{id}`) for random
rollouts, and the run's statistics (`GET /review/api/stats?run=`). The database is dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from app.db.session import build_sessionmaker
from app.review.seed import SeedSpec, seed_run
from app.review.service import RolloutReview
from app.review.statistics import RunStatistics
from app.review.stats_repository import StatsRepository
from bench.run import DEFAULT_PG_ADMIN, DEFAULT_REDIS, Environment

RUN = "bench"


async def measure(url: str, args: argparse.Namespace) -> None:
    engine = create_async_engine(url, pool_size=8)
    try:
        started = time.perf_counter()
        calls = 0
        batches = max(1, args.rollouts // args.batch)
        for k in range(batches):
            spec = SeedSpec(
                run=RUN,
                rollouts=args.batch,
                items=args.items,
                trace_prefix=f"b{k}",
                seed=k,
                start=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(days=k),
            )
            result = await seed_run(engine, spec)
            calls += result.calls
        seeded = time.perf_counter() - started
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            # What autovacuum does to an insert-heavy table (Postgres 13+) before long: statistics, and a
            # visibility map so that the covering index answers without visiting the table.
            await conn.execute(text("VACUUM (ANALYZE)"))
        print(f"seeded {batches * args.batch} rollouts and {calls} calls in {seeded:.0f} s", flush=True)

        sessions = build_sessionmaker(engine)
        rng = random.Random(1)
        timeline_ms = []
        for _ in range(args.timelines):
            trace = f"b{rng.randrange(batches)}_{RUN}_{rng.randrange(args.batch):07d}"
            async with sessions() as session:
                t0 = time.perf_counter()
                await RolloutReview(session).detail(trace)
                timeline_ms.append((time.perf_counter() - t0) * 1000)
        stats_s = []
        for _ in range(args.repeats):
            async with sessions() as session:
                t0 = time.perf_counter()
                stats = await RunStatistics(session, sessions=sessions).run_stats(RUN)
                stats_s.append(time.perf_counter() - t0)
        # Each query of the statistics on its own (they run concurrently, on separate connections).
        singles: dict[str, float] = {}
        queries = {
            "reward_distribution": lambda r: r.reward_distribution(RUN, None, 10),
            "call_stats": lambda r: r.call_stats(RUN),
            "calls_per_rollout": lambda r: r.calls_per_rollout(RUN),
            "item_summary": lambda r: r.item_summary(RUN, None, min_rollouts=2, zero=0.0, one=1.0),
            "flag_counts": lambda r: r.flag_counts(RUN, None),
        }
        for name, query in queries.items():
            async with sessions() as session:
                t0 = time.perf_counter()
                await query(StatsRepository(session))
                singles[name] = time.perf_counter() - t0
        timeline_ms.sort()
        print(
            f"run statistics over {stats.rollouts} rollouts: median {statistics.median(stats_s):.2f} s "
            f"(runs: {', '.join(f'{s:.2f}' for s in stats_s)})"
        )
        print("  each query alone: " + ", ".join(f"{k} {v:.2f} s" for k, v in singles.items()))
        print(
            f"timeline: p50 {timeline_ms[len(timeline_ms) // 2]:.1f} ms, "
            f"p90 {timeline_ms[int(len(timeline_ms) * 0.9)]:.1f} ms over {len(timeline_ms)} rollouts"
        )
    finally:
        await engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=10_000, help="rollouts seeded per transaction")
    parser.add_argument("--items", type=int, default=2_000)
    parser.add_argument("--timelines", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    args = parser.parse_args(argv)
    env = Environment(
        Path(tempfile.mkdtemp(prefix="sparring-bench-review-")), args.pg_admin_url, args.redis_url, False
    )
    env.create_postgres()
    try:
        asyncio.run(measure(env.database_url, args))
    finally:
        env.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
