"""Fixtures of the system tests: servers stopped after each test, a fresh Postgres database per module."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from app.db.migrate import upgrade
from tests.conftest import create_pg_database, drop_pg_database
from tests.system.helpers import Servers


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    started = Servers(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture(scope="module")
async def module_database(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A migrated Postgres database of its own for this test module."""
    module = request.module.__name__.rsplit(".", 1)[-1]
    name = f"sparring_sys_{module}_{os.getpid()}"
    url = await create_pg_database(name)
    await asyncio.to_thread(upgrade, url)
    yield url
    await drop_pg_database(name)
