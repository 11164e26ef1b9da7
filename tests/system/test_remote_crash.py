"""A worker killed in the middle of a remote rollout: another worker reports the rollout as an error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.remote.model_server import ModelServer
from tests.remote.processor import Row, init_request, wait_terminated
from tests.system.helpers import TOOLS_HEADERS, Servers, server_settings


@pytest.fixture
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    server.start()
    yield server
    server.stop()


async def test_a_killed_worker_leaves_an_error_not_a_finished_rollout(
    servers: Servers, module_database: str, tmp_path: Path, model: ModelServer
) -> None:
    def settings(worker: str) -> dict[str, str]:
        return server_settings(
            database_url=module_database,
            redis_url=None,
            home=tmp_path / worker,
            worker=worker,
            SPARRING_REMOTE_LEASE_SECONDS="1",
            SPARRING_REMOTE_ALLOWED_HOSTS="127.0.0.1",  # the scripted model listens on loopback
        )

    first = await servers.start("first", settings("first"))
    row = Row.new()
    body = init_request(
        row, model="hold", model_base_url=model.base_url(), messages=[{"role": "user", "content": "hi"}]
    )
    async with httpx.AsyncClient(base_url=first.url, headers=TOOLS_HEADERS, timeout=10) as client:
        assert (await client.post("/remote/init", json=body)).status_code == 200
        running = (await client.get("/remote/status", params={"rollout_id": row.rollout_id})).json()
        assert running["terminated"] is False
    first.kill()  # SIGKILL: no shutdown hook marks anything

    second = await servers.start("second", settings("second"))
    async with httpx.AsyncClient(base_url=second.url, headers=TOOLS_HEADERS, timeout=10) as client:
        status = await wait_terminated(client, "/remote", row.rollout_id, polls=300, interval=0.1)
    assert status["state"] == "error"
    assert "stopped (restart or crash)" in status["reason"]
    assert status["status"]["code"] == 10
    assert status["reward"] is None
