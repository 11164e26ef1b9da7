"""Runner fixtures: the scripted OpenAI-compatible model server, and apps on Postgres + Redis only."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from sparring.http import Retry
from sparring.session import Target, server_target
from tests.conftest import ADMIN_KEY, GRADER_KEY, TOOLS_KEY
from tests.runner.model_server import ModelServer

SERVER = "http://sparring"  # the base URL of the in-process app clients

# Retries without waiting: the tests count attempts, not seconds.
NO_WAIT = Retry(attempts=3, delay_s=0.0, max_delay_s=0.0)


@pytest.fixture
def backend() -> str:
    """The runner drives the real backend (Postgres + Redis), as a training service would."""
    return "real"


@pytest.fixture(scope="session")
def model_server_process() -> Iterator[ModelServer]:
    server = ModelServer().start()
    yield server
    server.stop()


@pytest.fixture
def model_server(model_server_process: ModelServer) -> ModelServer:
    """The shared server with a fresh script and request log for this test."""
    model_server_process.requests.clear()
    model_server_process.preflights.clear()
    model_server_process.ids_per_answer = False
    model_server_process.script = lambda request: (_ for _ in ()).throw(AssertionError("no script set"))
    return model_server_process


@pytest.fixture
async def openai_client(model_server: ModelServer) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="test-key", base_url=model_server.base_url, max_retries=0)


class Outage(httpx.AsyncBaseTransport):
    """A faulty proxy in front of sparring: the first `failures` attempts of every call (of `tool`, or of
    every tool) get a 503."""

    def __init__(self, inner: httpx.AsyncBaseTransport, failures: int, tool: str | None = None) -> None:
        self.inner = inner
        self.failures = failures
        self.tool = tool
        self.attempts: Counter[tuple[str, str]] = Counter()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/tools/") and (
            self.tool is None or request.url.path == f"/tools/{self.tool}"
        ):
            body = json.loads(await request.aread())
            key = (body["trace_id"], body["call_id"])
            self.attempts[key] += 1
            if self.attempts[key] <= self.failures:
                return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": "down"})
        return await self.inner.handle_async_request(request)


def target(grader: str, *, tools_key: str = TOOLS_KEY) -> Target:
    return server_target(SERVER, tools_key=tools_key, grader_key=GRADER_KEY, grader=grader)


def write_graders(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


async def admin_get(client: httpx.AsyncClient, url: str) -> Any:
    response = await client.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200, response.text
    return response.json()
