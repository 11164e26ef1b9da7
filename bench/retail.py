"""The retail pack at 1,000 concurrent rollouts: tool calls per second and memory per rollout.

    python -m bench.retail                        # 1,000 rollouts, Postgres + Redis and embedded
    python -m bench.retail --rollouts 200 --backends pg   # a quicker look

sparring runs with SPARRING_PACKS=retail (the data from `sparring packs fetch retail`, found under
.sparring/ or SPARRING_RETAIL_DATA), on Postgres + Redis (`pg`: a fresh database, Redis db 13 flushed)
and on the embedded backend (`embedded`: SQLite file, in-memory state). All rollouts start at once;
each replays the gold calls of a train task in order (reads and writes: lookups, then cancellations,
returns, exchanges, address and payment changes), so the mix is the benchmark's own. The same client
sends the same number of calls, with the same concurrency, to the bare echo app `--echo-repeats` times
just before and just after each sparring run: the ratio is taken against the median of those.

Memory per rollout, once every rollout has finished its task:
- `pg`: the bytes of the rollouts' Redis keys (`MEMORY USAGE` summed over the bench database: each
  rollout's changed records, its ledger answers and its metadata), and Redis `used_memory` after minus
  before (the whole instance: noisier when others use it);
- `embedded`: the server process's resident memory after minus before (state and ledger live there).

Afterwards every rollout is graded with `POST /grade/retail` (with a final answer that states the task's
`communicate_info`): all must score 1.0, i.e. 1,000 concurrent rollouts did not see each other's writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import uvloop
from redis import Redis

from bench.cpu import snapshot
from bench.run import (
    BENCH_DIR,
    DEFAULT_PG_ADMIN,
    DEFAULT_REDIS,
    Environment,
    Server,
    clean_env,
    cpu_seconds,
    finite,
    machine_info,
    retail_data_dir,
)
from tools.retail.tasks import get_task, replay_calls, split_task_ids

Plan = list[tuple[str, dict[str, Any]]]
WRITE_PREFIXES = ("cancel", "modify", "return", "exchange")


@dataclass(frozen=True)
class PackBench:
    """What the bench needs of a τ²-bench pack: its data, its train tasks as plans, how to grade them."""

    pack: str
    data_dir: Callable[[], Path]  # the pack's data (its SPARRING_<PACK>_DATA, else fetched once)
    train: Callable[[Path], list[str]]  # the train split's task ids
    plan: Callable[[Path, str], Plan]  # a task's calls, in order
    answer: Callable[[Path, str], str]  # a final answer stating everything the task must communicate
    is_write: Callable[[str], bool]  # whether a tool changes the database (for the report)
    warm: tuple[str, dict[str, Any]]  # a read call that makes the server load its base
    serve: bool = False  # start the server with `sparring serve` (as users run it), not uvicorn's factory
    # Every call of a rollout carries `item: {"task_id": ...}` (a pack that sets up each rollout from its
    # task, such as telecom); a plan's call named `user-tools/<name>` goes to the simulated user's route.
    task_items: bool = False

    @property
    def data_setting(self) -> str:
        return f"SPARRING_{self.pack.upper()}_DATA"


def _retail_answer(data: Path, task_id: str) -> str:
    return "Done. " + " and ".join(get_task(data, task_id).evaluation_criteria.communicate_info)


RETAIL = PackBench(
    pack="retail",
    data_dir=retail_data_dir,
    train=lambda data: split_task_ids(data, "train"),
    plan=lambda data, task_id: replay_calls(get_task(data, task_id)),
    answer=_retail_answer,
    is_write=lambda name: name.startswith(WRITE_PREFIXES),
    warm=("list_all_product_types", {}),
)


@dataclass
class Drive:
    calls: int
    seconds: float
    server_cpu_s: float
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.calls / self.seconds

    @property
    def cpu_ms_per_call(self) -> float:
        return self.server_cpu_s * 1000 / max(self.calls, 1)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")


async def drive(
    url: str,
    key: str,
    plans: list[Plan],
    connections: int,
    nonce: str,
    pid: int,
    items: list[dict[str, Any]] | None = None,
) -> Drive:
    """Run every plan as one rollout (trace_<nonce>_<index>), all at once, over `connections` keep-alive
    HTTP/1.1 connections: a rollout's next call is sent only after its previous answer arrived, and goes
    to the back of one shared queue, so all rollouts progress together. Rollout `i`'s calls carry
    `items[i]`; a call named `user-tools/<name>` is sent to that route (a simulated user's tool).

    A minimal HTTP client (asyncio streams, Content-Length bodies): a general-purpose client such as
    httpx costs the load generator more CPU per call than the echo server spends, which would make the
    baseline measure the client.
    """
    parsed = urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    prefix = f"HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{auth}"
    queue: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()
    for index, plan in enumerate(plans):
        if plan:
            queue.put_nowait((index, 0))
    remaining = sum(len(plan) for plan in plans)
    latencies: list[float] = []
    failures: list[str] = []

    async def connection() -> None:
        nonlocal remaining
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while (job := await queue.get()) is not None:
                index, step = job
                name, arguments = plans[index][step]
                path = f"/{name}" if "/" in name else f"/tools/{name}"
                body = orjson.dumps(
                    {
                        "type": "function_call",
                        "call_id": f"call_{step}",
                        "id": f"fc_{step}",
                        "name": name.rpartition("/")[2],
                        "arguments": orjson.dumps(arguments).decode(),
                        "trace_id": f"trace_{nonce}_{index}",
                        "item": items[index] if items is not None else {},
                    }
                )
                sent = time.perf_counter()
                writer.write(f"POST {path} {prefix}Content-Length: {len(body)}\r\n\r\n".encode() + body)
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                if length is None:
                    raise RuntimeError(f"answer without Content-Length: {head!r}")
                answer = await reader.readexactly(int(length.group(1)))
                latencies.append((time.perf_counter() - sent) * 1000)
                if head[9:12] != b"200":
                    failures.append(f"{name} of rollout {index}: {head[:12]!r} {answer[:200]!r}")
                remaining -= 1
                if step + 1 < len(plans[index]):
                    queue.put_nowait((index, step + 1))
                elif remaining == 0:
                    for _ in range(connections):
                        queue.put_nowait(None)
        finally:
            writer.close()

    before = snapshot(pid)
    started = time.perf_counter()
    # one failing connection fails the whole run (gather raises at once); the timeout bounds a stall
    await asyncio.wait_for(asyncio.gather(*(connection() for _ in range(connections))), timeout=900)
    seconds = time.perf_counter() - started
    after = snapshot(pid)
    if failures:
        raise RuntimeError(f"{len(failures)} calls not answered 200, e.g. {failures[:3]}")
    return Drive(len(latencies), seconds, cpu_seconds(before, after, pid), latencies)


async def grade_all(
    spec: PackBench, url: str, key: str, nonce: str, tasks: list[str], connections: int, data: Path
) -> list[float]:
    """The pack grader's score of every rollout, with a final answer stating everything to communicate."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=120) as client:
        gate = asyncio.Semaphore(connections)

        async def grade(index: int, task_id: str) -> float:
            async with gate:
                return await graded(index, task_id)

        async def graded(index: int, task_id: str) -> float:
            answer = spec.answer(data, task_id)
            response = await client.post(
                f"/grade/{spec.pack}",
                json={
                    "sample": {"output_text": answer},
                    "item": {"task_id": task_id},
                    "trace_id": f"trace_{nonce}_{index}",
                },
            )
            response.raise_for_status()
            return float(response.json()["score"])

        return list(await asyncio.gather(*(grade(i, t) for i, t in enumerate(tasks))))


def used_memory(url: str) -> int:
    client = Redis.from_url(url)
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def keys_memory(url: str) -> tuple[int, int]:
    """(number of keys, sum of MEMORY USAGE) over the bench's Redis database."""
    client = Redis.from_url(url)
    try:
        count = total = 0
        for key in client.scan_iter(count=1000):
            count += 1
            total += int(client.memory_usage(key, samples=0) or 0)
        return count, total
    finally:
        client.close()


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def warm(spec: PackBench, url: str, key: str) -> None:
    """One read call on a throwaway rollout, so the base database is loaded before memory is measured."""
    name, arguments = spec.warm
    body = {"call_id": "warm", "trace_id": f"trace_warm_{secrets.token_hex(4)}", "arguments": arguments}
    response = httpx.post(
        f"{url}/tools/{name}",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    response.raise_for_status()


def run_backend(
    spec: PackBench,
    backend: str,
    args: argparse.Namespace,
    data: Path,
    plans: list[Plan],
    echo_plans: list[Plan],
    tasks: list[str],
) -> dict[str, Any]:
    tools_key, grader_key = secrets.token_hex(16), secrets.token_hex(16)
    workdir = Path(tempfile.mkdtemp(prefix=f"sparring-bench-{spec.pack}-"))
    env = Environment(workdir, args.pg_admin_url, args.redis_url, False)
    logs = env.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    base = clean_env()
    sparring_env = {
        **base,
        "SPARRING_API_KEYS": f"tools:{tools_key},grader:{grader_key}",
        "SPARRING_PACKS": spec.pack,
        spec.data_setting: str(data),
        "SPARRING_HOME": str(env.workdir / "home"),
    }
    if backend == "pg":
        env.create_postgres()
        sparring_env |= {
            "SPARRING_DATABASE_URL": env.database_url,
            "SPARRING_REDIS_URL": env.redis_url,
            "SPARRING_REDIS_MAX_CONNECTIONS": "256",
        }
    else:
        env.create_sqlite()
        sparring_env["SPARRING_DATABASE_URL"] = f"sqlite+aiosqlite:///{env.sqlite_path}"
    echo = Server("echo", "bench.echo_app:app", dict(base), logs / "echo.log")
    sparring = Server(
        f"sparring-{spec.pack}-{backend}",
        "app.main:create_app",
        sparring_env,
        logs / "sparring.log",
        factory=True,
        ready_path="/readyz",
        command=[str(Path(sys.executable).parent / "sparring"), "serve"] if spec.serve else None,
    )
    nonce = secrets.token_hex(4)
    result: dict[str, Any] = {"backend": backend}
    try:
        for server in (echo, sparring):
            server.start()
        for server in (echo, sparring):
            server.wait_ready(timeout=120)
        warm(spec, sparring.url, tools_key)
        if backend == "pg":
            redis_before = used_memory(env.redis_url)
            keys_before = keys_memory(env.redis_url)
        rss_before = rss(sparring.pid)
        echo_1 = [
            uvloop.run(drive(echo.url, "", echo_plans, args.connections, f"e1{i}{nonce}", echo.pid))
            for i in range(args.echo_repeats)
        ]
        items = [{"task_id": task_id} for task_id in tasks] if spec.task_items else None
        served = uvloop.run(
            drive(sparring.url, tools_key, plans, args.connections, nonce, sparring.pid, items)
        )
        rss_after = rss(sparring.pid)
        if backend == "pg":
            redis_after = used_memory(env.redis_url)
            keys_after = keys_memory(env.redis_url)
            result["redis_keys_per_rollout"] = (keys_after[0] - keys_before[0]) / args.rollouts
            result["redis_key_bytes_per_rollout"] = (keys_after[1] - keys_before[1]) / args.rollouts
            result["redis_used_memory_per_rollout"] = (redis_after - redis_before) / args.rollouts
        echo_2 = [
            uvloop.run(drive(echo.url, "", echo_plans, args.connections, f"e2{i}{nonce}", echo.pid))
            for i in range(args.echo_repeats)
        ]
        grading = grade_all(spec, sparring.url, grader_key, nonce, tasks, args.grade_connections, data)
        scores = uvloop.run(grading)
    finally:
        for server in (sparring, echo):
            server.stop()
        env.teardown()
    echoes = echo_1 + echo_2
    echo_rate = statistics.median(e.rate for e in echoes)
    echo_cpu = statistics.median(e.cpu_ms_per_call for e in echoes)
    result |= {
        "calls": served.calls,
        "seconds": served.seconds,
        "calls_per_s": served.rate,
        "echo_calls_per_s": [e.rate for e in echoes],
        "echo_calls_per_s_median": echo_rate,
        "ratio_to_echo": served.rate / echo_rate,
        "p50_ms": served.percentile(50),
        "p99_ms": served.percentile(99),
        "server_cpu_ms_per_call": served.cpu_ms_per_call,
        "echo_cpu_ms_per_call": echo_cpu,
        "cpu_ratio_to_echo": echo_cpu / served.cpu_ms_per_call if served.cpu_ms_per_call else None,
        "server_rss_before": rss_before,
        "server_rss_after": rss_after,
        "server_rss_per_rollout": (rss_after - rss_before) / args.rollouts,
        "graded": len(scores),
        "graded_1_0": sum(1 for s in scores if s == 1.0),
        "mean_score": sum(scores) / len(scores) if scores else None,
    }
    return result


def main(argv: list[str] | None = None, spec: PackBench = RETAIL, description: str | None = __doc__) -> int:
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--connections", type=int, default=64, help="client connections (HTTP/1.1)")
    parser.add_argument("--backends", default="pg,embedded", help="pg and/or embedded")
    parser.add_argument(
        "--grade-connections",
        type=int,
        default=10,
        help="grades sent at once after the run (a grade holds one of the server's 10 database connections)",
    )
    parser.add_argument(
        "--echo-repeats", type=int, default=3, help="echo runs before and after each sparring run (median)"
    )
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    args = parser.parse_args(argv)

    data = spec.data_dir()
    train = spec.train(data)
    tasks = [train[i % len(train)] for i in range(args.rollouts)]
    plans = [spec.plan(data, task) for task in tasks]
    echo_plans: list[Plan] = [[("echo", {"text": f"hello {step}"}) for step in range(len(p))] for p in plans]
    writes = sum(1 for plan in plans for name, _ in plan if spec.is_write(name))
    total = sum(len(plan) for plan in plans)
    started = datetime.now(UTC)
    info = machine_info()
    print(
        f"{args.rollouts} rollouts at once (train tasks in turn), {total} calls ({writes} writes), "
        f"{args.connections} connections",
        flush=True,
    )
    results = []
    for backend in args.backends.split(","):
        r = run_backend(spec, backend, args, data, plans, echo_plans, tasks)
        results.append(r)
        echo_rates = " ".join(f"{e:.0f}" for e in r["echo_calls_per_s"])
        print(
            f"{backend}: {r['calls_per_s']:.0f} calls/s "
            f"(p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms); "
            f"echo, same client and calls, before and after: {echo_rates} calls/s; "
            f"ratio {r['ratio_to_echo']:.2f}; "
            f"server CPU {r['server_cpu_ms_per_call']:.2f} ms/call (echo {r['echo_cpu_ms_per_call']:.2f}); "
            f"graded 1.0: {r['graded_1_0']}/{r['graded']}",
            flush=True,
        )
        if backend == "pg":
            print(
                f"  Redis: {r['redis_keys_per_rollout']:.1f} keys, "
                f"{r['redis_key_bytes_per_rollout'] / 1024:.1f} KiB (MEMORY USAGE) per rollout; "
                f"used_memory {r['redis_used_memory_per_rollout'] / 1024:.1f} KiB per rollout; "
                f"server RSS {r['server_rss_per_rollout'] / 1024:+.1f} KiB per rollout",
                flush=True,
            )
        else:
            print(
                f"  server RSS {r['server_rss_before'] / 2**20:.0f} -> "
                f"{r['server_rss_after'] / 2**20:.0f} MiB: "
                f"{r['server_rss_per_rollout'] / 1024:.1f} KiB per rollout",
                flush=True,
            )
    out_dir = BENCH_DIR / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{spec.pack}-{started.strftime('%Y%m%d-%H%M%S')}.json"
    summary = {
        "started_at": started.isoformat(),
        "finished_at": datetime.now(UTC).isoformat(),
        "machine": info,
        "config": vars(args),
        "calls": total,
        "writes": writes,
        "results": results,
    }
    out.write_text(json.dumps(finite(summary), indent=2))
    print(f"results: {out}")
    failed = [r["backend"] for r in results if r["graded_1_0"] != r["graded"]]
    if failed:
        print(f"error: some rollouts did not score 1.0 on {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
