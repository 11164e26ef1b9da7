"""Several server processes sharing Postgres and Redis (one or a cluster), one of them killed under load."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import ADMIN_KEY, REDIS_URL
from tests.redis_cluster import LocalCluster
from tests.system.helpers import (
    BASE_VALUE,
    TOOLS_HEADERS,
    CounterLoad,
    Servers,
    counter_output,
    logged_calls,
    new_trace,
    server_settings,
)

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SEQUENTIAL = 6
PARALLEL_STEPS = {"p0": 10, "p1": 20, "p2": 40, "p3": 80}  # every subset has its own sum
FINAL = BASE_VALUE + SEQUENTIAL + sum(PARALLEL_STEPS.values())


def increment(trace: str, call_id: str, by: int) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call_id}",
        "call_id": call_id,
        "arguments": orjson.dumps({"by": by}).decode(),
        "trace_id": trace,
    }


async def two_servers(
    servers: Servers, database: str, tmp_path: Path, redis_url: str = REDIS_URL, **extra: str
) -> tuple[str, str]:
    a, b = await asyncio.gather(
        *(
            servers.start(
                name,
                server_settings(
                    database_url=database, redis_url=redis_url, home=tmp_path / name, worker=name, **extra
                ),
            )
            for name in ("A", "B")
        )
    )
    return a.url, b.url


@pytest.mark.parametrize("redis", ["one", "cluster"])
async def test_one_rollout_spread_over_two_servers_sees_one_state(
    servers: Servers, module_database: str, tmp_path: Path, redis: str, request: pytest.FixtureRequest
) -> None:
    if redis == "cluster":  # the two processes share a local Redis Cluster (tests/redis_cluster.py)
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        a, b = await two_servers(
            servers, module_database, tmp_path, cluster.url, SPARRING_REDIS_CLUSTER="true"
        )
    else:
        a, b = await two_servers(servers, module_database, tmp_path)
    urls = [a, b]

    async with httpx.AsyncClient(headers=TOOLS_HEADERS, timeout=30) as client:

        async def call(url: str, trace: str, call_id: str, by: int) -> str:
            r = await client.post(f"{url}/tools/increment", json=increment(trace, call_id, by))
            assert r.status_code == 200, (url, r.status_code, r.text)
            return str(r.json()["output"])

        async def read(url: str, trace: str) -> int:
            r = await client.post(f"{url}/tools/read_counter", json={"trace_id": trace, "arguments": "{}"})
            assert r.status_code == 200, r.text
            return int(orjson.loads(r.json()["output"])["value"])

        async def rollout(trace: str) -> None:
            # Sequential calls alternating between the servers; each retried on the other server.
            for k in range(SEQUENTIAL):
                first = await call(urls[k % 2], trace, f"s{k}", 1)
                assert first == counter_output(BASE_VALUE + k + 1), f"{trace} s{k} answered {first}"
                assert await call(urls[(k + 1) % 2], trace, f"s{k}", 1) == first
            # Both servers read what was written, whichever wrote it.
            assert await read(urls[0], trace) == await read(urls[1], trace) == BASE_VALUE + SEQUENTIAL
            # A parallel batch spread over both servers, each call duplicated at once on the other one.
            jobs = [(urls[i % 2], c) for i, c in enumerate(PARALLEL_STEPS)]
            jobs += [(urls[(i + 1) % 2], c) for i, c in enumerate(PARALLEL_STEPS)]
            outputs = await asyncio.gather(*(call(u, trace, c, PARALLEL_STEPS[c]) for u, c in jobs))
            by_call: dict[str, set[str]] = {}
            for (_, c), out in zip(jobs, outputs, strict=True):
                by_call.setdefault(c, set()).add(out)
            assert all(len(v) == 1 for v in by_call.values()), f"{trace}: duplicates differ: {by_call}"
            # Answers of some serial order: no lost update between the two processes.
            ordered = sorted((orjson.loads(next(iter(v)))["value"], c) for c, v in by_call.items())
            previous = BASE_VALUE + SEQUENTIAL
            for value, c in ordered:
                assert value - previous == PARALLEL_STEPS[c], f"{trace}: {ordered} is not serializable"
                previous = value
            assert await read(a, trace) == await read(b, trace) == FINAL

        traces = [new_trace() for _ in range(8)]
        await asyncio.wait_for(asyncio.gather(*(rollout(t) for t in traces)), 120)

        # Read back through either server: the same rollout, with calls from both workers.
        for trace in traces:
            views = [(await client.get(f"{url}/rollouts/{trace}", headers=ADMIN)).json() for url in urls]
            assert views[0] == views[1]
            increments = [c for c in views[0]["timeline"] if c["tool"] == "increment"]
            # Retries and duplicates are logged once; the calls were answered by both workers.
            assert len(increments) == SEQUENTIAL + len(PARALLEL_STEPS)
            assert {c["worker"] for c in increments} == {"A", "B"}
            states = [
                (await client.get(f"{url}/rollouts/{trace}/state", headers=ADMIN)).json() for url in urls
            ]
            assert states[0] == states[1]
            assert states[0]["packs"]["counter"]["state"]["counters"]["main"]["value"] == FINAL

    rows = await logged_calls(module_database, traces)
    answered = [r for r in rows if r["status_code"] == 200 and r["tool"] == "increment"]
    assert len(answered) == len(traces) * (SEQUENTIAL + len(PARALLEL_STEPS))
    assert len({(r["trace_id"], r["call_id"]) for r in answered}) == len(answered)


KILL_ROUNDS = 3  # an answer sent before its commit is caught by one kill or another
ANSWERS_PER_ROUND = 40


async def test_sigkilled_worker_lost_nothing_it_answered(
    servers: Servers, module_database: str, tmp_path: Path
) -> None:
    def settings(name: str) -> dict[str, str]:
        return server_settings(
            database_url=module_database, redis_url=REDIS_URL, home=tmp_path / name, worker=name
        )

    names = ["survivor"] + [f"victim-{i}" for i in range(1, KILL_ROUNDS + 1)]
    survivor, *victims = await asyncio.gather(*(servers.start(n, settings(n)) for n in names))
    worker_of = {server.url: server.name for server in (survivor, *victims)}
    # Calls alternate between the current victim and the survivor; a retry goes to the other server.
    load = CounterLoad([victims[0].url, survivor.url], workers=16, calls_per_rollout=8, pause=0.05)
    load.start()
    try:
        for victim in victims:
            load.urls[0] = victim.url
            await load.wait_for(
                lambda v=victim: load.answered_since(0, v.url) >= ANSWERS_PER_ROUND,
                90,
                f"{victim.name} answers",
            )
            victim.kill()  # SIGKILL while calls are in flight: no shutdown hook, no flush
        killed = time.monotonic()
        await load.wait_for(lambda: load.answered_since(killed) >= 40, 90, "answers after the last kill")
    finally:
        await load.stop(grace=2)

    assert not load.violations, load.violations[:10]
    victim_urls = {v.url for v in victims}
    # Only 200, 503 or a connection dropped by a killed worker ever happened.
    odd = [(x.url, x.status, x.error) for x in load.attempts if x.status not in (200, 503)]
    assert all(url in victim_urls and status is None for url, status, _ in odd), odd[:5]

    # Every call answered with 200, by a victim or by the survivor, is in the log with its output.
    rows = await logged_calls(module_database, load.rollouts)
    assert load.check_log(rows) == []
    # A call a victim answered at its first attempt was logged by that victim itself.
    first_attempt: dict[tuple[str, str], Any] = {}
    for x in load.attempts:
        first_attempt.setdefault((x.trace_id, x.call_id), x)
    logged_by = {(r["trace_id"], r["call_id"]): r["worker"] for r in rows if r["status_code"] == 200}
    for victim in victims:
        answered = [x for x in load.answers.values() if x.url == victim.url]
        assert len(answered) >= ANSWERS_PER_ROUND, f"{victim.name} answered too little to prove anything"
        for x in answered:
            if first_attempt[(x.trace_id, x.call_id)] is x:
                assert logged_by[(x.trace_id, x.call_id)] == worker_of[victim.url]
    # State agrees with what was answered (a call cut off by a kill may or may not have applied).
    assert await load.check_counters(survivor.url) == []


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_metrics_in_a_given_directory_count_every_workers_calls(
    servers: Servers, module_database: str, tmp_path: Path, workers: str
) -> None:
    """SPARRING_METRICS_DIR (documented in .env.example): the workers write their metrics there and
    /metrics sums them (it read an empty directory while each worker counted in its memory)."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    settings = server_settings(
        database_url=module_database,
        redis_url=REDIS_URL,
        home=tmp_path / "M",
        worker="M",
        SPARRING_WORKERS=workers,
        SPARRING_METRICS_DIR=str(metrics_dir),
    )
    server = await servers.start("M", settings, cli=True)
    async with httpx.AsyncClient(headers=TOOLS_HEADERS, timeout=30) as client:
        trace = new_trace()
        for n in range(4):
            r = await client.post(f"{server.url}/tools/increment", json=increment(trace, f"m{n}", 1))
            assert r.status_code == 200, r.text
        text = (await client.get(f"{server.url}/metrics", headers=ADMIN)).text
    assert 'sparring_tool_calls_total{outcome="ok",tool="increment"} 4.0' in text, text[:2000]


def test_a_dead_workers_calls_in_flight_leave_the_gauge(tmp_path: Path) -> None:
    """A worker killed during calls (and replaced by uvicorn) counted them in flight: the gauge is the
    live workers' sum, so they leave it (they stayed in it for good); what it answered stays counted."""
    import os
    import subprocess
    import sys

    from app.metrics import Metrics

    worker = (
        "from app.metrics import Metrics\n"
        f"m = Metrics({str(tmp_path)!r})\n"
        "m.tool_calls.labels('echo', 'ok').inc()\n"
        "m.in_flight.inc(3)\n"  # then SIGKILLed, as it were: it never decrements
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", worker], env=env, check=True, timeout=60)
    text = Metrics(str(tmp_path)).exposition().decode()
    assert 'sparring_tool_calls_total{outcome="ok",tool="echo"} 1.0' in text, text
    assert "sparring_tool_calls_in_flight 3.0" not in text, text
