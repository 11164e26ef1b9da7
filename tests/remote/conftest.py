"""Remote rollout fixtures: apps that may reach the loopback model servers these tests start."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from tests.conftest import AppFactory

LOOPBACK = ["127.0.0.1"]


@pytest.fixture
def app_factory(app_factory: AppFactory) -> AppFactory:
    """The app factory with SPARRING_REMOTE_ALLOWED_HOSTS=127.0.0.1, as local development sets it:
    the scripted model servers listen on loopback, which remote rollouts refuse by default."""

    @asynccontextmanager
    async def factory(*args: Any, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
        overrides.setdefault("remote_allowed_hosts", LOOPBACK)
        async with app_factory(*args, **overrides) as client:
            yield client

    return factory
