"""10,000 concurrent rollouts against `sparring serve` (retail pack, Postgres + Redis), each calling a
tool every 1–5 s as a model would, compared in the same run with 100 rollouts at the same total rate.

    python -m bench.tenk                                  # 10,000 vs 100 rollouts, then on the cluster
    python -m bench.tenk --modes single --duration 30     # a quicker look, one Redis only
    python -m bench.tenk --rollouts 20 --baseline-rollouts 4 --duration 2 \
        --min-interval 0.2 --max-interval 0.5             # the smoke test's scale

For each mode the server is started as users start it (`sparring serve`, its defaults, the retail pack):

- `single`: one worker (the default), one Redis (a bench database of the shared instance);
- `cluster`: `SPARRING_WORKERS=2` on a local three-shard Redis Cluster (`SPARRING_REDIS_CLUSTER=true`,
  started as tests/redis_cluster.py does), a fresh Postgres database.

Each mode runs two phases on the same server, one after the other:

1. **baseline**: `--baseline-rollouts` (100) rollouts, each calling every `min/k`–`max/k` s with
   k = rollouts ÷ baseline-rollouts (100× as often), so the total call rate is the same as in phase 2;
2. **many**: `--rollouts` (10,000) rollouts, each calling every `--min-interval`–`--max-interval` s.

A rollout is what a model does: its first call comes at a random moment in the first interval (the
ramp) and carries `item: {"task_id": ...}` (a retail task, as a trainer sends its dataset row); then it
waits a random think time (uniform in the interval), calls again, and so on, one call at a time. The
tools are the retail pack's, on the rollout's own customer (a user of the data): lookups of the user,
the user's orders and products, and changes of the user's address (a write, under the rollout lock).
Every call has a unique call id.

Latency is measured from the moment a call was due (its rollout's schedule), not from when it was sent,
so a generator or server that falls behind is not hidden (no coordinated omission). Only calls due in
the measured window (after the ramp, for `--duration` s) count for p50/p99; errors count over the whole
phase. The generator is `--procs` processes of asyncio + aiohttp (pooled keep-alive connections, at
most `--connections` per process); its CPU and how late it woke for a due call are reported, so a
generator that was the bottleneck shows.

Reported per phase: calls/s, p50/p99/max, errors; the server's own time per call (p50/p99 of the
call log's `ended_at - started_at`, which excludes the HTTP layer, the wait for the log commit and
the generator); the server's resident memory (the whole process tree:
master and workers) and CPU; Postgres connections (`pg_stat_activity` on the bench database, sampled
every second, max); and for the many-rollouts phase: RSS growth per live rollout (RSS at the end of the
many phase minus at the end of the baseline, ÷ the added rollouts), Redis `used_memory` growth per
rollout (summed over shards), and the bytes of the rollouts' keys (`MEMORY USAGE`) per rollout. The
worker count needed is the server's CPU per call times the rate the rollouts asked for, over 0.7 of a
core per worker, rounded up. The whole machine's busy share is reported too: on a shared machine the
server may get less than a core, and then falls behind whatever its own cost.

After the many phase the baseline runs once more (`baseline_after`, its ratio `p99_ratio_to_after`):
on a shared machine whose load drifts, a many phase worse than both baselines around it is the
rollouts' doing, not the neighbours'.

Checks (exit status 1 when one fails): 0 errors; p99 of the many phase ≤ 3 × p99 of the baseline; RSS
growth ≤ 5 KiB per live rollout. Results: bench/results/tenk-<stamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import secrets
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from redis import Redis

from bench.run import (
    BENCH_DIR,
    DEFAULT_PG_ADMIN,
    DEFAULT_REDIS,
    Environment,
    Server,
    build_servers,
    finite,
    machine_info,
    pg_url,
    retail_data_dir,
    running,
)

BUSY_PER_WORKER = 0.7  # a worker's share of a core to plan for (above it, queueing grows the p99)
TARGET_P99_RATIO = 3.0
TARGET_RSS_PER_ROLLOUT = 5 * 1024
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


# --- the load generator (runs in its own processes) ----------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What one generator process does in one phase."""

    url: str
    key: str
    prefix: str  # trace ids are <prefix><index>
    indexes: list[int]  # the rollouts this process drives
    min_interval: float
    max_interval: float
    start_at: float  # wall clock (time.time) of the phase's start, the same for every process
    ramp: float
    duration: float
    connections: int
    ids: dict[str, list[str]]  # user, product and task ids of the retail data
    user_orders: dict[str, list[str]]  # each user's order ids
    seed: int


@dataclass
class Outcome:
    calls: int = 0
    ok: int = 0
    non_2xx: int = 0
    failed: int = 0
    first_calls: int = 0
    # Calls due before the end that were never sent: their rollout was still behind its schedule when
    # the phase's hard stop came (the server, or the generator, could not keep the rate).
    unsent: int = 0
    latencies_ms: list[float] = field(default_factory=list)  # calls due in the measured window
    late_ms: list[float] = field(default_factory=list)  # how late the generator sent each call
    service_ms: list[float] = field(default_factory=list)  # from sending to the answer (window only)
    not_2xx: list[str] = field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0


def _arguments(
    rng: random.Random, ids: dict[str, list[str]], user: str, orders: list[str], n: int
) -> tuple[str, dict[str, Any]]:
    """A retail call as a model makes them for its customer: mostly lookups of the customer, their
    orders and products, some changes of the customer's address (a write, under the rollout lock)."""
    draw = rng.random()
    if draw < 0.45 and orders:
        return "get_order_details", {"order_id": rng.choice(orders)}
    if draw < 0.70:
        return "get_user_details", {"user_id": user}
    if draw < 0.85:
        return "get_product_details", {"product_id": rng.choice(ids["product"])}
    return "modify_user_address", {
        "user_id": user, "address1": f"{n} Elm Street", "address2": "Suite 1",
        "city": "Austin", "state": "TX", "country": "USA", "zip": "78701",
    }  # fmt: skip


async def _drive(plan: Plan) -> Outcome:
    import aiohttp
    import orjson

    out = Outcome()
    rng = random.Random(plan.seed)
    headers = {"Authorization": f"Bearer {plan.key}", "Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=plan.connections)
    timeout = aiohttp.ClientTimeout(total=30)
    # Wall clock -> this process's monotonic clock.
    start = time.perf_counter() + (plan.start_at - time.time())
    measure_from, end = start + plan.ramp, start + plan.ramp + plan.duration
    hard_stop = end + max(5.0, plan.max_interval)
    url = plan.url + "/tools"
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as client:

        async def rollout(index: int) -> None:
            trace = f"{plan.prefix}{index}"
            task_id = plan.ids["task"][index % len(plan.ids["task"])]
            # The rollout's customer (a model works on one customer's account).
            user = plan.ids["user"][index % len(plan.ids["user"])]
            orders = plan.user_orders.get(user, [])
            due = start + rng.uniform(0, plan.ramp)
            n = 0
            while due < end:
                if time.perf_counter() > hard_stop:
                    while due < end:
                        out.unsent += 1
                        due += rng.uniform(plan.min_interval, plan.max_interval)
                    return
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent = time.perf_counter()
                out.late_ms.append(max(0.0, sent - due) * 1000)
                name, arguments = _arguments(rng, plan.ids, user, orders, n)
                body: dict[str, Any] = {
                    "type": "function_call",
                    "call_id": f"call_{trace}_{n}",
                    "name": name,
                    "arguments": orjson.dumps(arguments).decode(),
                    "trace_id": trace,
                }
                if n == 0:  # a rollout's first call says which dataset row it is
                    body["item"] = {"task_id": task_id}
                    out.first_calls += 1
                out.calls += 1
                try:
                    async with client.post(url, data=orjson.dumps(body)) as response:
                        payload = await response.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    out.failed += 1
                    if len(out.not_2xx) < 20:
                        out.not_2xx.append(f"failed: {exc!r}")
                else:
                    if 200 <= response.status < 300:
                        out.ok += 1
                    else:
                        out.non_2xx += 1
                        if len(out.not_2xx) < 20:
                            out.not_2xx.append(f"{response.status} {payload[:200].decode(errors='replace')}")
                    if due >= measure_from:
                        answered = time.perf_counter()
                        out.latencies_ms.append((answered - due) * 1000)
                        out.service_ms.append((answered - sent) * 1000)
                n += 1
                # The next call is due a think time after this one was due (a model answering slowly
                # does not slow its schedule down: a late answer makes the next call late, and measured).
                due += rng.uniform(plan.min_interval, plan.max_interval)

        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(rollout(i) for i in plan.indexes))
        out.cpu_s, out.wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    return out


def generate(plan: Plan) -> Outcome:
    """Entry point of a generator process."""
    import uvloop

    return uvloop.run(_drive(plan))


# --- measuring the server and its services -------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (the workers of `sparring serve --workers N`)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(parents.get(current, []))
    return tree


def tree_rss(pid: int) -> int:
    total = 0
    for p in process_tree(pid):
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * _PAGE
        except OSError:
            pass
    return total


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all cores so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return float(sum(fields) - idle), float(sum(fields))


def tree_cpu(pid: int) -> float:
    total = 0.0
    for p in process_tree(pid):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


class Sampler:
    """Every second, in a thread: the server tree's RSS and Postgres connections to the bench database."""

    def __init__(self, pid: int, admin_url: str, database: str) -> None:
        self.pid, self.admin_url, self.database = pid, admin_url, database
        self.rss: list[int] = []
        self.pg: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self._sample())

    async def _sample(self) -> None:
        import asyncpg

        # One connection to the admin database (not counted: only the bench database's are).
        conn = await asyncpg.connect(self.admin_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            while not self._stop.is_set():
                self.rss.append(tree_rss(self.pid))
                self.pg.append(
                    int(
                        await conn.fetchval(
                            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1", self.database
                        )
                    )
                )
                await asyncio.to_thread(self._stop.wait, 1.0)
        finally:
            await conn.close()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


async def _server_times(admin_url: str, database: str, prefixes: list[str]) -> dict[str, list[float]]:
    import asyncpg

    conn = await asyncpg.connect(
        pg_url(admin_url, database).replace("postgresql+asyncpg://", "postgresql://")
    )
    try:
        times: dict[str, list[float]] = {}
        for prefix in prefixes:
            row = await conn.fetchrow(
                "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d), percentile_cont(0.99) WITHIN GROUP"
                " (ORDER BY d) FROM (SELECT extract(epoch FROM ended_at - started_at) * 1000 AS d"
                " FROM tool_calls WHERE starts_with(trace_id, $1)) t",
                prefix,
            )
            times[prefix] = [float(row[0] or "nan"), float(row[1] or "nan")] if row else []
        return times
    finally:
        await conn.close()


def server_times(admin_url: str, database: str, prefixes: list[str]) -> dict[str, list[float]]:
    """p50 and p99 (ms) of the server's own time per call (the call log's `ended_at - started_at`:
    from the call's start in the service to its answer, before the log commit it then waits for),
    for the calls of the rollouts whose trace ids start with each prefix."""
    return asyncio.run(_server_times(admin_url, database, prefixes))


def redis_nodes(url: str, cluster_ports: list[int] | None) -> list[Redis]:
    if cluster_ports:
        return [Redis(host="127.0.0.1", port=port) for port in cluster_ports]
    return [Redis.from_url(url)]


def used_memory(nodes: list[Redis]) -> int:
    return sum(int(node.info("memory")["used_memory"]) for node in nodes)


def keys_memory(nodes: list[Redis], match: str) -> tuple[int, int]:
    """(keys, sum of MEMORY USAGE) of the keys matching `match`, over every node."""
    count = total = 0
    for node in nodes:
        batch: list[bytes] = []
        for key in node.scan_iter(match=match, count=1000):
            batch.append(key)
            count += 1
            if len(batch) >= 1000:
                total += _memory_usage(node, batch)
                batch = []
        total += _memory_usage(node, batch)
    return count, total


def _memory_usage(node: Redis, keys: list[bytes]) -> int:
    pipe = node.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key, samples=0)
    return sum(int(v or 0) for v in pipe.execute()) if keys else 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


# --- one phase, one mode --------------------------------------------------------------------------------


def run_phase(
    args: argparse.Namespace,
    server: Server,
    key: str,
    ids: dict[str, Any],
    prefix: str,
    rollouts: int,
    scale: float,
) -> dict[str, Any]:
    """`rollouts` rollouts, their intervals divided by `scale`, for ramp + duration seconds."""
    min_i, max_i = args.min_interval / scale, args.max_interval / scale
    procs = max(1, min(args.procs, rollouts))
    start_at = time.time() + 1.5 + 0.2 * procs  # the processes' start-up before the clock starts
    plans = [
        Plan(
            url=server.url,
            key=key,
            prefix=prefix,
            indexes=list(range(p, rollouts, procs)),
            min_interval=min_i,
            max_interval=max_i,
            start_at=start_at,
            ramp=max_i,
            duration=args.duration,
            connections=args.connections,
            ids={k: v for k, v in ids.items() if k != "user_orders"},
            user_orders=ids["user_orders"],
            seed=hash((prefix, p)) & 0xFFFFFFFF,
        )
        for p in range(procs)
    ]
    phase_s = max_i + args.duration
    machine0 = machine_cpu()
    cpu0 = tree_cpu(server.pid)
    t0 = time.monotonic()
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        # Bounded, and interruptible (Ctrl-C stops the generators; the servers and databases are removed).
        outcomes = pool.map_async(generate, plans).get(timeout=phase_s + 120)
    wall = time.monotonic() - t0
    server_cpu = tree_cpu(server.pid) - cpu0
    machine1 = machine_cpu()
    service = [x for o in outcomes for x in o.service_ms]
    latencies = [x for o in outcomes for x in o.latencies_ms]
    late = [x for o in outcomes for x in o.late_ms]
    calls = sum(o.calls for o in outcomes)
    result = {
        "rollouts": rollouts,
        "interval_s": [min_i, max_i],
        "calls": calls,
        "calls_per_s": len(latencies) / args.duration,
        "scheduled_calls_per_s": rollouts * 2 / (min_i + max_i),
        "ok": sum(o.ok for o in outcomes),
        "non_2xx": sum(o.non_2xx for o in outcomes),
        "failed": sum(o.failed for o in outcomes),
        "errors": sum(o.non_2xx + o.failed for o in outcomes),
        "first_calls": sum(o.first_calls for o in outcomes),
        "unsent": sum(o.unsent for o in outcomes),
        "measured_calls": len(latencies),
        "p50_ms": percentile(latencies, 50),
        "p90_ms": percentile(latencies, 90),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies, default=float("nan")),
        "service_p50_ms": percentile(service, 50),
        "service_p99_ms": percentile(service, 99),
        "generator_late_p99_ms": percentile(late, 99),
        # The share of all the machine's cores that was busy (the neighbours' work included).
        "machine_busy": (machine1[0] - machine0[0]) / max(machine1[1] - machine0[1], 1e-9),
        "generator_cpu_cores": sum(o.cpu_s for o in outcomes) / max(phase_s, 1e-9),
        "generator_max_process_busy": max(o.cpu_s / max(o.wall_s, 1e-9) for o in outcomes),
        "generator_processes": procs,
        "server_cpu_cores": server_cpu / max(wall, 1e-9),
        "server_cpu_ms_per_call": server_cpu * 1000 / max(calls, 1),
        "not_2xx": [s for o in outcomes for s in o.not_2xx][:20],
    }
    return result


def run_mode(args: argparse.Namespace, mode: str, ids: dict[str, Any], data: Path) -> dict[str, Any]:
    key = "tenk-" + secrets.token_urlsafe(18)
    env = Environment(
        workdir=Path(tempfile.mkdtemp(prefix=f"sparring-tenk-{mode}-")),
        pg_admin_url=args.pg_admin_url,
        redis_url=args.redis_url,
        keep=False,
    )
    cluster = None
    workers = args.workers if mode == "single" else args.cluster_workers
    try:
        env.create_postgres()
        env.retail_data = data
        serve_env = [f"SPARRING_WORKERS={workers}"] if workers != 1 else []
        redis_url = env.redis_url
        cluster_ports: list[int] | None = None
        if mode == "cluster":
            cluster = start_cluster()
            redis_url, cluster_ports = cluster.url, cluster.ports
            serve_env += ["SPARRING_REDIS_CLUSTER=true", f"SPARRING_REDIS_URL={redis_url}"]
        servers = build_servers({"sparring-serve"}, env, key, serve_env)
        server = servers["sparring-serve"]
        assert env.pg_database is not None
        nodes = redis_nodes(redis_url, cluster_ports)
        nonce = secrets.token_hex(3)
        with running(servers):
            time.sleep(2 if workers > 1 else 0.5)  # every worker up and its pools open
            print(f"[{mode}] sparring serve, {workers} worker(s), pid {server.pid}, {server.url}", flush=True)
            scale = args.rollouts / args.baseline_rollouts
            with Sampler(server.pid, args.pg_admin_url, env.pg_database) as base_sampler:
                baseline = run_phase(args, server, key, ids, f"tenk_{nonce}_b", args.baseline_rollouts, scale)
            print(f"[{mode}] baseline: {line(baseline)}", flush=True)
            rss_before = tree_rss(server.pid)
            redis_before = used_memory(nodes)
            with Sampler(server.pid, args.pg_admin_url, env.pg_database) as many_sampler:
                many = run_phase(args, server, key, ids, f"tenk_{nonce}_m", args.rollouts, 1.0)
            rss_after = tree_rss(server.pid)
            redis_after = used_memory(nodes)
            n_keys, key_bytes = keys_memory(nodes, f"*tenk_{nonce}_m*")
            print(f"[{mode}] many:     {line(many)}", flush=True)
            # The baseline again, after: on a shared machine whose load drifts, a many phase worse than
            # both baselines around it is the rollouts' doing, not the neighbours'.
            again = run_phase(args, server, key, ids, f"tenk_{nonce}_a", args.baseline_rollouts, scale)
            print(f"[{mode}] again:    {line(again)}", flush=True)
            phases = {"b": baseline, "m": many, "a": again}
            own = server_times(args.pg_admin_url, env.pg_database, [f"tenk_{nonce}_{k}" for k in phases])
            for k, phase in phases.items():
                phase["server_own_p50_ms"], phase["server_own_p99_ms"] = own.get(f"tenk_{nonce}_{k}") or [
                    float("nan"),
                    float("nan"),
                ]
            print(
                f"[{mode}] the server's own time per call (call log), p50 / p99 ms: "
                + ", ".join(
                    f"{name} {p['server_own_p50_ms']:.1f} / {p['server_own_p99_ms']:.1f}"
                    for name, p in (("baseline", baseline), ("many", many), ("again", again))
                ),
                flush=True,
            )
        baseline["rss_mb_end"] = base_sampler.rss[-1] / 2**20 if base_sampler.rss else float("nan")
        baseline["pg_connections_max"] = max(base_sampler.pg, default=0)
        added = args.rollouts  # the baseline's rollouts were live already before the many phase
        many.update(
            rss_mb_before=rss_before / 2**20,
            rss_mb_after=rss_after / 2**20,
            rss_mb_peak=max(many_sampler.rss, default=0) / 2**20,
            rss_bytes_per_rollout=(rss_after - rss_before) / added,
            redis_used_memory_per_rollout=(redis_after - redis_before) / added,
            redis_keys=n_keys,
            redis_keys_per_rollout=n_keys / added,
            redis_key_bytes_per_rollout=key_bytes / added,
            pg_connections_max=max(many_sampler.pg, default=0),
        )
        # The server's CPU per call times the rate the rollouts asked for (not the rate it managed).
        cores = (
            max(baseline["server_cpu_ms_per_call"], many["server_cpu_ms_per_call"])
            * many["scheduled_calls_per_s"]
            / 1000
        )
        result = {
            "mode": mode,
            "workers": workers,
            "redis": "cluster of 3 shards" if cluster is not None else "one instance",
            "baseline": baseline,
            "many": many,
            "baseline_after": again,
            "p99_ratio_to_after": many["p99_ms"] / again["p99_ms"] if again["p99_ms"] else float("nan"),
            "p99_ratio": many["p99_ms"] / baseline["p99_ms"] if baseline["p99_ms"] else float("nan"),
            "p50_ratio": many["p50_ms"] / baseline["p50_ms"] if baseline["p50_ms"] else float("nan"),
            "server_cores_needed": cores,
            "workers_needed": max(1, math.ceil(cores / BUSY_PER_WORKER)),
        }
        return result
    finally:
        if cluster is not None:
            cluster.close()
        env.teardown()


def start_cluster() -> Any:
    """A local three-shard Redis Cluster, as the tests start one (tests/redis_cluster.py)."""
    import shutil
    import subprocess

    from tests.redis_cluster import SHARDS, LocalCluster, _free_port

    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise RuntimeError("the cluster mode needs redis-server and redis-cli (Debian's redis-server)")
    cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="sparring-tenk-cluster-")))
    try:
        for _ in range(SHARDS):
            port = _free_port()
            cluster.ports.append(port)
            cluster.start_node(port)
        nodes = [f"127.0.0.1:{port}" for port in cluster.ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            timeout=60,
            check=True,
        )
        cluster.wait_ok()
    except BaseException:
        cluster.close()
        raise
    return cluster


def line(r: dict[str, Any]) -> str:
    return (
        f"{r['rollouts']:>6} rollouts, {r['calls_per_s']:7.1f} calls/s "
        f"(due {r['scheduled_calls_per_s']:.0f}/s, {r['unsent']} unsent), p50 {r['p50_ms']:6.1f} ms, "
        f"p99 {r['p99_ms']:7.1f} ms, max {r['max_ms']:7.1f} ms (answer after sending: p50 "
        f"{r['service_p50_ms']:.1f}, p99 {r['service_p99_ms']:.1f} ms), {r['errors']} errors; server "
        f"{r['server_cpu_cores']:.2f} cores ({r['server_cpu_ms_per_call']:.2f} ms/call); generator "
        f"{r['generator_cpu_cores']:.2f} cores, busiest process {r['generator_max_process_busy']:.0%}, "
        f"late p99 {r['generator_late_p99_ms']:.1f} ms; machine {r['machine_busy']:.0%} busy"
    )


def retail_ids(data: Path) -> dict[str, Any]:
    from tools.retail.tasks import split_task_ids

    db = json.loads((data / "db.json").read_text())
    return {
        "user": sorted(db["users"]),
        "user_orders": {user: list(record.get("orders", [])) for user, record in db["users"].items()},
        "product": sorted(db["products"]),
        "task": split_task_ids(data, "train"),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tenk", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--rollouts", type=int, default=10_000, help="rollouts of the many phase (10,000)")
    parser.add_argument("--baseline-rollouts", type=int, default=100, help="rollouts of the baseline (100)")
    parser.add_argument("--min-interval", type=float, default=1.0, help="shortest think time, s (1)")
    parser.add_argument("--max-interval", type=float, default=5.0, help="longest think time, s (5)")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds per phase (60)")
    parser.add_argument("--modes", default="single,cluster", help="single, cluster or both (default)")
    parser.add_argument("--workers", type=int, default=1, help="workers of the single mode (1: the default)")
    parser.add_argument("--cluster-workers", type=int, default=2, help="workers of the cluster mode (2)")
    parser.add_argument("--procs", type=int, default=2, help="load generator processes (2)")
    parser.add_argument("--connections", type=int, default=128, help="connections per generator process")
    parser.add_argument("--pg-admin-url", default=os.environ.get("BENCH_PG_ADMIN_URL", DEFAULT_PG_ADMIN))
    parser.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", DEFAULT_REDIS))
    parser.add_argument("--results-dir", type=Path, default=BENCH_DIR / "results")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("single", "cluster") for m in modes):
        parser.error("--modes takes single, cluster or single,cluster")
    args.modes = modes
    if not (0 < args.min_interval <= args.max_interval and args.duration > 0):
        parser.error("need 0 < --min-interval <= --max-interval and --duration > 0")
    if not (1 <= args.baseline_rollouts < args.rollouts <= 100_000):
        parser.error("need 1 <= --baseline-rollouts < --rollouts <= 100000")
    return args


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # the `finally` blocks stop the servers and the cluster's processes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    started = datetime.now(UTC)
    info = machine_info()
    data = retail_data_dir()
    ids = retail_ids(data)
    modes = [run_mode(args, mode, ids, data) for mode in args.modes]

    checks: dict[str, bool] = {}
    print()
    for r in modes:
        b, m = r["baseline"], r["many"]
        print(
            f"{r['mode']} ({r['workers']} worker(s), Redis {r['redis']}): "
            f"p99 {m['p99_ms']:.1f} ms at {m['rollouts']} rollouts vs {b['p99_ms']:.1f} ms at "
            f"{b['rollouts']} = {r['p99_ratio']:.2f}x (after: {r['baseline_after']['p99_ms']:.1f} ms, "
            f"{r['p99_ratio_to_after']:.2f}x; p50 {m['p50_ms']:.1f} vs {b['p50_ms']:.1f} ms); "
            f"RSS {m['rss_mb_before']:.1f} -> {m['rss_mb_after']:.1f} MB = "
            f"{m['rss_bytes_per_rollout'] / 1024:+.2f} KiB per rollout; Redis used_memory "
            f"{m['redis_used_memory_per_rollout'] / 1024:.2f} KiB, keys {m['redis_keys_per_rollout']:.1f} "
            f"({m['redis_key_bytes_per_rollout'] / 1024:.2f} KiB) per rollout; Postgres connections max "
            f"{b['pg_connections_max']} / {m['pg_connections_max']}; workers needed {r['workers_needed']}"
        )
        for s in m["not_2xx"] + b["not_2xx"]:
            print(f"  not 2xx: {s}")
        checks[f"{r['mode']}: 0 errors, every due call sent"] = (
            b["errors"] == 0 and m["errors"] == 0 and b["unsent"] == 0 and m["unsent"] == 0
        )
        checks[f"{r['mode']}: every rollout started"] = m["first_calls"] == args.rollouts
        checks[f"{r['mode']}: p99 <= {TARGET_P99_RATIO:g}x the baseline's"] = (
            r["p99_ratio"] <= TARGET_P99_RATIO
        )
        checks[f"{r['mode']}: RSS growth <= 5 KiB per live rollout"] = (
            m["rss_bytes_per_rollout"] <= TARGET_RSS_PER_ROLLOUT
        )
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")

    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"tenk-{started.strftime('%Y%m%d-%H%M%S')}.json"
    report = {
        "started_at": started.isoformat(),
        "finished_at": datetime.now(UTC).isoformat(),
        "machine": info,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "modes": modes,
        "checks": checks,
    }
    out.write_text(json.dumps(finite(report), indent=2))
    print(f"results: {out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
