"""Fixtures: apps on the embedded backend (SQLite + memory) and the real one (Postgres + Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from app.config import Settings
from app.db.migrate import upgrade
from app.main import create_app
from app.sdk import Pack
from tests.packs import counter_pack, faults_pack
from tests.redis_cluster import LocalCluster, local_cluster

PG_ADMIN_URL = os.environ.get("SPARRING_TEST_PG", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("SPARRING_TEST_REDIS", "redis://127.0.0.1:6379/9")
# Unique per run: the session's Postgres database and every Redis key it makes carry it, so runs on a
# shared machine never meet, and the session deletes exactly what it made when it ends.
RUN_ID = f"{os.getpid()}_{uuid.uuid4().hex[:8]}"
REDIS_KEY_PREFIX = f"sptest-{RUN_ID}"
TOOLS_KEY, GRADER_KEY, ADMIN_KEY = "tools-key-123", "grader-key-456", "admin-key-789"
API_KEYS = f"tools:{TOOLS_KEY},grader:{GRADER_KEY},admin:{ADMIN_KEY}"

BACKENDS = ["embedded", "real"]
# The suites that must hold on a Redis Cluster too take these (tests/redis_cluster.py starts one).
CLUSTER_BACKENDS = [*BACKENDS, "cluster"]


def pg_url(database: str) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{database}"


async def create_pg_database(name: str) -> str:
    engine = create_async_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    async with engine.connect() as conn:
        await conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        await conn.execute(text(f'CREATE DATABASE "{name}"'))
    await engine.dispose()
    return pg_url(name)


async def drop_pg_database(name: str) -> None:
    engine = create_async_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    async with engine.connect() as conn:
        await conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    await engine.dispose()


@pytest.fixture(scope="session")
async def pg_database() -> AsyncIterator[str]:
    """One migrated Postgres database for the session (tests isolate themselves by unique trace ids)."""
    name = f"sparring_test_{RUN_ID}"
    url = await create_pg_database(name)
    await asyncio.to_thread(upgrade, url)
    yield url
    await drop_pg_database(name)


def delete_redis_keys(url: str, prefix: str) -> int:
    """Delete every key under `prefix:` in the Redis at `url` (nothing else); how many there were."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    deleted = 0
    try:
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += int(client.unlink(*batch))
                batch = []
        if batch:
            deleted += int(client.unlink(*batch))
    finally:
        client.close()
    return deleted


@pytest.fixture(scope="session", autouse=True)
def redis_cleanup() -> Iterator[None]:
    """At the end of the session, the Redis keys this run made (under REDIS_KEY_PREFIX) are deleted."""
    yield
    import redis

    with contextlib.suppress(redis.RedisError):  # no Redis: the tests that need it were skipped
        delete_redis_keys(REDIS_URL, REDIS_KEY_PREFIX)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """A local three-shard Redis Cluster shared by the session's `cluster` backend tests."""
    with local_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file, copied for each test that needs a fresh embedded database."""
    path = tmp_path_factory.mktemp("sqlite") / "template.db"
    upgrade(f"sqlite+aiosqlite:///{path}")
    return path


def make_settings(home: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "home": home,
        "api_keys": API_KEYS,
        "packs": ["demo"],
        "redis_key_prefix": REDIS_KEY_PREFIX,
    }
    values.update(overrides)
    return Settings(**values)


AppFactory = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def backend_settings(
    backend: str, tmp_path: Path, sqlite_template: Path, request: pytest.FixtureRequest
) -> dict[str, Any]:
    """Settings overrides selecting the backend under test."""
    if backend == "embedded":
        db = tmp_path / "sparring.db"
        db.write_bytes(sqlite_template.read_bytes())
        return {"database_url": f"sqlite+aiosqlite:///{db}", "redis_url": None}
    pg = request.getfixturevalue("pg_database")
    if backend == "cluster":  # Postgres and a Redis Cluster (suites that list it among their backends)
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        return {"database_url": pg, "redis_url": cluster.url, "redis_cluster": True}
    return {"database_url": pg, "redis_url": REDIS_URL}


@pytest.fixture
def app_factory(tmp_path: Path, backend_settings: dict[str, Any]) -> AppFactory:
    """Start an app (lifespan included) on the backend under test and yield an HTTP client for it."""

    @asynccontextmanager
    async def factory(
        packs: list[Pack] | None = None,
        key: str | None = TOOLS_KEY,
        pack_settings: dict[str, dict[str, Any]] | None = None,
        **overrides: Any,
    ) -> AsyncIterator[httpx.AsyncClient]:
        settings = make_settings(tmp_path / "home", **{**backend_settings, **overrides})
        app = create_app(
            settings,
            packs=packs if packs is not None else [counter_pack, faults_pack],
            pack_settings=pack_settings,
        )
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with LifespanManager(app) as manager:
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://sparring", headers=headers
            ) as client:
                client.app = app  # type: ignore[attr-defined]
                yield client

    return factory


@pytest.fixture
async def client(app_factory: AppFactory) -> AsyncIterator[httpx.AsyncClient]:
    async with app_factory() as c:
        yield c


def new_trace() -> str:
    return f"trace_{uuid.uuid4().hex}"


def call_body(
    arguments: Any = None, *, trace_id: str | None = None, call_id: str | None = None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "function_call", **extra}
    if arguments is not None:
        body["arguments"] = arguments
    if trace_id is not None:
        body["trace_id"] = trace_id
    if call_id is not None:
        body["call_id"] = call_id
    return body
