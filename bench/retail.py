"""The retail pack at 1,000 concurrent rollouts: tool calls per second and Redis memory per rollout.

    python -m bench.retail                        # 1,000 rollouts, every train task's gold calls
    python -m bench.retail --rollouts 200         # a quicker look

sparring runs on Postgres + Redis with SPARRING_PACKS=retail (the data from `sparring packs fetch
retail`, found under .sparring/ or SPARRING_RETAIL_DATA). All rollouts start at once; each replays
the gold calls of a train task in order (reads and writes: lookups, then cancellations, returns,
exchanges, address and payment changes), so the mix is the benchmark's own. The same client then
sends the same number of calls, with the same concurrency, to the bare echo app: the ratio is
taken against that run. Memory: Redis `used_memory` after the load minus before, per rollout
(each rollout's changed records, its ledger answers and its metadata).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from redis import Redis

from bench.run import DEFAULT_PG_ADMIN, DEFAULT_REDIS, ROOT, Environment, Server, clean_env
from tools.retail import data
from tools.retail.tasks import replay_calls, split_task_ids


async def drive(url: str, key: str, plans: list[list[tuple[str, dict[str, Any]]]], connections: int) -> float:
    """Run every plan as one rollout, all at once; returns calls per second."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    nonce = secrets.token_hex(4)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=120) as client:

        async def rollout(index: int, plan: list[tuple[str, dict[str, Any]]]) -> int:
            trace = f"trace_{nonce}_{index}"
            for step, (name, arguments) in enumerate(plan):
                body = {
                    "type": "function_call",
                    "call_id": f"call_{step}",
                    "id": f"fc_{step}",
                    "name": name,
                    "arguments": orjson.dumps(arguments).decode(),
                    "trace_id": trace,
                    "item": {},
                }
                response = await client.post(f"/tools/{name}", json=body)
                response.raise_for_status()
            return len(plan)

        started = time.perf_counter()
        calls = sum(await asyncio.gather(*(rollout(i, plan) for i, plan in enumerate(plans))))
        return calls / (time.perf_counter() - started)


def used_memory(url: str) -> int:
    client = Redis.from_url(url)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--connections", type=int, default=64, help="client connections (HTTP/1.1)")
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    args = parser.parse_args(argv)

    retail_data = Path(
        os.environ.get("SPARRING_RETAIL_DATA") or data.fetch(data.cache_dir(ROOT / ".sparring"))
    )
    data.configure(retail_data, ROOT / ".sparring")
    tasks = split_task_ids("train")
    plans = [replay_calls(tasks[i % len(tasks)]) for i in range(args.rollouts)]
    echo_plans = [[("echo", {"text": f"hello {step}"}) for step in range(len(plan))] for plan in plans]
    writes = sum(
        1 for plan in plans for name, _ in plan if name.startswith(("cancel", "modify", "return", "exchange"))
    )
    total = sum(len(plan) for plan in plans)

    key = secrets.token_hex(16)
    env = Environment(
        Path(tempfile.mkdtemp(prefix="sparring-bench-retail-")), args.pg_admin_url, args.redis_url, False
    )
    env.create_postgres()
    logs = env.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    base = clean_env()
    echo = Server("echo", "bench.echo_app:app", dict(base), logs / "echo.log")
    sparring = Server(
        "sparring-retail",
        "app.main:create_app",
        {
            **base,
            "SPARRING_API_KEYS": f"tools:{key}",
            "SPARRING_PACKS": "retail",
            "SPARRING_RETAIL_DATA": str(retail_data),
            "SPARRING_HOME": str(env.workdir / "home"),
            "SPARRING_DATABASE_URL": env.database_url,
            "SPARRING_REDIS_URL": env.redis_url,
            "SPARRING_REDIS_MAX_CONNECTIONS": "256",
        },
        logs / "sparring.log",
        factory=True,
        ready_path="/readyz",
    )
    try:
        for server in (echo, sparring):
            server.start()
        for server in (echo, sparring):
            server.wait_ready(timeout=120)
        before = used_memory(env.redis_url)
        echo_rate = asyncio.run(drive(echo.url, "", echo_plans, args.connections))
        rate = asyncio.run(drive(sparring.url, key, plans, args.connections))
        after = used_memory(env.redis_url)
        echo_again = asyncio.run(drive(echo.url, "", echo_plans, args.connections))
    finally:
        for server in (sparring, echo):
            server.stop()
        env.teardown()
    baseline = (echo_rate + echo_again) / 2
    print(
        f"{args.rollouts} rollouts at once, {total} calls ({writes} writes), {args.connections} connections"
    )
    print(
        f"retail: {rate:.0f} calls/s; echo (same client): {baseline:.0f} calls/s; ratio {rate / baseline:.2f}"
    )
    print(
        f"Redis memory: {(after - before) / args.rollouts / 1024:.1f} KiB per rollout "
        f"({(after - before) / 1024 / 1024:.1f} MiB for {args.rollouts})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
