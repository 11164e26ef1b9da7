"""Redis and Postgres stopped and restarted under load: 503 during, correct after, nothing answered lost."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from app.db.migrate import upgrade
from tests.conftest import ADMIN_KEY, REDIS_URL
from tests.system.helpers import (
    CounterLoad,
    Server,
    Servers,
    ThrowawayPostgres,
    ThrowawayRedis,
    logged_calls,
    new_trace,
    server_settings,
)

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

BEFORE = 40  # answers before the outage
DURING = 20  # 503s seen during the outage before the dependency comes back
AFTER = 60  # answers after it came back
OUTAGE = 1.5  # seconds, at least


@pytest.fixture
async def throwaway_redis() -> AsyncIterator[ThrowawayRedis]:
    redis = ThrowawayRedis()
    try:
        await asyncio.to_thread(redis.start)
        yield redis
    finally:
        await asyncio.to_thread(redis.cleanup)


@pytest.fixture
async def throwaway_postgres() -> AsyncIterator[ThrowawayPostgres]:
    pg = ThrowawayPostgres()
    try:
        await asyncio.to_thread(pg.init)
        await asyncio.to_thread(pg.start)
        yield pg
    finally:
        await asyncio.to_thread(pg.cleanup)


async def run_outage(
    server: Server, stop: Callable[[], Awaitable[None]], restart: Callable[[], Awaitable[None]]
) -> tuple[CounterLoad, float, float]:
    """Load the server, stop the dependency, wait for 503s, restart it, wait for correct answers."""
    load = CounterLoad([server.url], workers=10, calls_per_rollout=8, pause=0.1)
    load.start()
    try:
        await load.wait_for(lambda: len(load.answers) >= BEFORE, 90, "answers before the outage")
        await stop()
        down = time.monotonic()
        # The outage lasts until the load has met it often enough, and for at least OUTAGE seconds.
        await load.wait_for(
            lambda: load.statuses_since(down, 503) >= DURING and time.monotonic() - down >= OUTAGE,
            60,
            "503s during the outage",
        )
        up = time.monotonic()
        await restart()
        # The server recovers by itself: no restart, no intervention.
        await load.wait_for(lambda: load.answered_since(up) >= AFTER, 90, "answers after the outage")
    finally:
        await load.stop()
    return load, down, up


def check_outage(load: CounterLoad, down: float, up: float) -> None:
    assert not load.violations, load.violations[:10]
    # During the outage: 503 with Retry-After, never a 4xx, never a 200 that pretends.
    during = load.within(down, up)
    assert len(during) >= DURING
    assert all(a.status == 503 and a.retry_after for a in during), [
        (a.status, a.retry_after) for a in during if a.status != 503 or not a.retry_after
    ][:5]
    # The server stayed up throughout: every attempt got an HTTP answer, 200 or 503.
    other = [(a.status, a.error) for a in load.attempts if a.status not in (200, 503)]
    assert not other, other[:5]
    # Answers before and after; every 200 carried the value a serial execution gives (checked as
    # they arrived by CounterLoad).
    assert len([a for a in load.answers.values() if a.received <= down]) >= BEFORE
    assert load.answered_since(up) >= AFTER


async def test_redis_outage(
    servers: Servers, module_database: str, throwaway_redis: ThrowawayRedis, tmp_path: Path
) -> None:
    server = await servers.start(
        "R",
        server_settings(
            database_url=module_database, redis_url=throwaway_redis.url, home=tmp_path / "r", worker="R"
        ),
    )

    async def stop() -> None:
        await asyncio.to_thread(throwaway_redis.stop)

    async def restart() -> None:
        await asyncio.to_thread(throwaway_redis.start)

    load, down, up = await run_outage(server, stop, restart)
    check_outage(load, down, up)
    # Nothing answered is missing from the log; state agrees with the answers.
    rows = await logged_calls(module_database, load.rollouts)
    assert load.check_log(rows) == []
    assert await load.check_counters(server.url) == []
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(f"{server.url}/readyz")).status_code == 200


async def test_postgres_outage(
    servers: Servers, throwaway_postgres: ThrowawayPostgres, tmp_path: Path
) -> None:
    database = await throwaway_postgres.create_database("sparring")
    await asyncio.to_thread(upgrade, database)
    server = await servers.start(
        "P", server_settings(database_url=database, redis_url=REDIS_URL, home=tmp_path / "p", worker="P")
    )

    async def stop() -> None:
        await asyncio.to_thread(throwaway_postgres.stop, "fast")

    async def restart() -> None:
        await asyncio.to_thread(throwaway_postgres.start)

    load, down, up = await run_outage(server, stop, restart)
    check_outage(load, down, up)
    rows = await logged_calls(database, load.rollouts)
    assert load.check_log(rows) == []
    # Calls that failed with 503 because the log was down were applied once, and their retries
    # replayed the stored answer: the counters agree with the answers exactly.
    assert await load.check_counters(server.url) == []
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(f"{server.url}/readyz")).status_code == 200


async def test_review_routes_answer_503_while_a_dependency_is_down(
    servers: Servers,
    throwaway_postgres: ThrowawayPostgres,
    throwaway_redis: ThrowawayRedis,
    tmp_path: Path,
) -> None:
    """The house rule: every infrastructure problem is a 503 with Retry-After, on every route."""
    database = await throwaway_postgres.create_database("sparring")
    await asyncio.to_thread(upgrade, database)
    graders = tmp_path / "graders.json"
    exact = {"type": "string_check", "name": "exact", "operation": "eq", "input": "a", "reference": "a"}
    graders.write_text(json.dumps({"exact": exact}))
    server = await servers.start(
        "V",
        server_settings(
            database_url=database,
            redis_url=throwaway_redis.url,
            home=tmp_path / "v",
            worker="V",
            SPARRING_GRADERS_FILE=str(graders),
        ),
    )
    trace = new_trace()
    routes = {
        "list": "/rollouts?limit=5",
        "detail": f"/rollouts/{trace}",
        "state": f"/rollouts/{trace}/state",
        "ready": "/readyz",
        "review": "/review/api/rollouts?limit=5",
        "stats": "/review/api/stats?run=none",
        "grade": "POST /grade/exact",
    }
    async with httpx.AsyncClient(base_url=server.url, headers=ADMIN, timeout=20) as client:
        call = {"call_id": "c1", "trace_id": trace, "arguments": '{"by": 2}'}
        assert (await client.post("/tools/increment", json=call)).status_code == 200

        async def statuses() -> dict[str, tuple[int | None, str | None]]:
            """Status and Retry-After per route (None and the error when no HTTP answer came)."""
            found: dict[str, tuple[int | None, str | None]] = {}
            for name, path in routes.items():
                try:
                    # A fresh connection each: a 500 makes the server drop a kept-alive connection.
                    if path.startswith("POST "):
                        grade = {"sample": {"output_text": "a"}, "trace_id": trace}
                        r = await client.post(path[5:], json=grade, headers={"Connection": "close"})
                    else:
                        r = await client.get(path, headers={"Connection": "close"})
                except httpx.HTTPError as exc:
                    found[name] = (None, repr(exc))
                else:
                    found[name] = (r.status_code, r.headers.get("Retry-After"))
            return found

        healthy = await statuses()
        assert {name: code for name, (code, _) in healthy.items()} == dict.fromkeys(routes, 200)

        await asyncio.to_thread(throwaway_redis.stop)
        try:
            redis_down = await statuses()
        finally:
            await asyncio.to_thread(throwaway_redis.start)
        await asyncio.to_thread(throwaway_postgres.stop, "fast")
        try:
            database_down = await statuses()
        finally:
            await asyncio.to_thread(throwaway_postgres.start)
        recovered = await statuses()

    # Reading the state needs Redis; reading the log needs the database.
    assert redis_down["state"][0] == 503 and redis_down["state"][1], redis_down
    assert redis_down["ready"][0] == 503, redis_down
    for name in ("list", "detail", "ready", "review", "stats", "grade"):
        assert database_down[name][0] == 503 and database_down[name][1], (name, database_down)
    assert {name: code for name, (code, _) in recovered.items()} == dict.fromkeys(routes, 200), recovered
