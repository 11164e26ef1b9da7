"""Replicas starting together against an empty database: the schema is migrated exactly once.

Two copies of the container's entrypoint (`deploy/entrypoint.sh migrate`: wait for the database, then
`sparring db upgrade`) are started while the test holds the migrations' advisory lock, so both are
provably running at once and queued on it; when the lock is released they migrate one after the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from app.db.migrate import head_revision
from app.db.models import Base
from tests.conftest import create_pg_database, drop_pg_database
from tests.deploy.procs import REPO, clean_env

ENTRYPOINT = REPO / "deploy" / "entrypoint.sh"
REPLICAS = 2


def migration_lock_id() -> int:
    match = re.search(
        r"^MIGRATION_LOCK_ID = (0x[0-9A-Fa-f_]+|\d+)", (REPO / "migrations" / "env.py").read_text(), re.M
    )
    assert match, "migrations/env.py no longer defines MIGRATION_LOCK_ID"
    return int(match.group(1).replace("_", ""), 0)


@pytest.fixture
async def empty_database() -> AsyncIterator[str]:
    name = f"sparring_migrate_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = await create_pg_database(name)
    yield url
    await drop_pg_database(name)


async def waiting_on_lock(conn: AsyncConnection, lock_id: int) -> int:
    # A bigint advisory key is stored as (classid, objid) = (high, low) 32 bits, objsubid 1.
    result = await conn.execute(
        text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid = :high AND objid = :low AND objsubid = 1 AND database ="
            " (SELECT oid FROM pg_database WHERE datname = current_database())"
        ),
        {"high": lock_id >> 32, "low": lock_id & 0xFFFFFFFF},
    )
    return int(result.scalar_one())


async def test_two_replicas_migrating_at_once_migrate_once(empty_database: str) -> None:
    lock_id = migration_lock_id()
    env = clean_env(SPARRING_DATABASE_URL=empty_database, DB_WAIT_SECONDS="30")
    engine = create_async_engine(empty_database, isolation_level="AUTOCOMMIT")
    replicas: list[asyncio.subprocess.Process] = []
    try:
        async with engine.connect() as holder, engine.connect() as observer:
            await holder.execute(text("SELECT pg_advisory_lock(:id)"), {"id": lock_id})
            for _ in range(REPLICAS):
                replicas.append(
                    await asyncio.create_subprocess_exec(
                        "sh",
                        str(ENTRYPOINT),
                        "migrate",
                        env=env,
                        cwd=REPO,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + 30
            while await waiting_on_lock(observer, lock_id) < REPLICAS:
                for proc in replicas:
                    assert proc.returncode is None, "a replica exited before taking the migration lock"
                assert time.monotonic() < deadline, "the replicas never queued on the migration lock"
                await asyncio.sleep(0.1)
            # Both replicas are inside `sparring db upgrade`, waiting: nothing is migrated yet.
            tables = await observer.execute(text("SELECT to_regclass('alembic_version')"))
            assert tables.scalar_one() is None
            await holder.execute(text("SELECT pg_advisory_unlock(:id)"), {"id": lock_id})

        results = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in replicas)), timeout=60)
        outputs = [out.decode(errors="replace") for out, _ in results]
        for proc, output in zip(replicas, outputs, strict=True):
            assert proc.returncode == 0, output
            assert "database schema is up to date" in output, output

        async with engine.connect() as conn:
            versions = (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalars().all()
            assert versions == [head_revision()]
            present = {
                row[0]
                for row in await conn.execute(
                    text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
                )
            }
            assert set(Base.metadata.tables) <= present
    finally:
        for proc in replicas:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
                await proc.wait()
        await engine.dispose()
