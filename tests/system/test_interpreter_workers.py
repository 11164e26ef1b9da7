"""The code pack's `python` interpreter across two real server processes on one Postgres and Redis: a
call that reaches the worker without the rollout's interpreter says the state is lost, never answers
from stale or missing state, and the rollout goes on there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REDIS_URL, TOOLS_KEY, new_trace
from tests.system.helpers import ROOT, Servers, server_settings
from tools.code import data
from tools.code.interpreter import RESTARTED

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def code_dir() -> Path:
    return data.DATA.fetch(data.DATA.cache_dir(ROOT / ".sparring"))


async def python(client: httpx.AsyncClient, url: str, trace: str, code: str, call_id: str) -> Any:
    body = {
        "type": "function_call",
        "call_id": call_id,
        "name": "python",
        "arguments": json.dumps({"code": code}),
        "trace_id": trace,
        "item": {},
    }
    response = await client.post(f"{url}/tools/python", json=body)
    assert response.status_code == 200, response.text
    output = str(response.json()["output"])
    return output if output.startswith("Error:") else json.loads(output)


async def test_a_call_on_the_other_worker_says_the_state_is_not_there(
    servers: Servers, module_database: str, code_dir: Path, tmp_path: Path
) -> None:
    started = []
    for name in ("a", "b"):
        settings = server_settings(
            database_url=module_database,
            redis_url=REDIS_URL,
            home=tmp_path / name,
            worker=f"interp-{name}",
            SPARRING_PACKS="code",
            SPARRING_CODE_DATA=str(code_dir),
        )
        started.append(await servers.start(name, settings))
    one, two = (server.url for server in started)
    trace = new_trace()
    headers = {"Authorization": f"Bearer {TOOLS_KEY}"}
    async with httpx.AsyncClient(headers=headers, timeout=30.0) as client:
        first = await python(client, one, trace, "x = 5\nx", "c1")
        elsewhere = await python(client, two, trace, "x", "c2")
        there = await python(client, two, trace, "x = 9\nx", "c3")
        back = await python(client, one, trace, "x", "c4")
        retried = await python(client, two, trace, "x = 9\nx", "c3")  # a retry replays, wherever it lands
    assert first["value"] == "5"
    assert elsewhere.startswith(f"Error: {RESTARTED}") and "another server process" in elsewhere
    assert there["value"] == "9"
    assert back.startswith(f"Error: {RESTARTED}")  # worker one's x = 5 is stale: never answered
    assert retried == there
