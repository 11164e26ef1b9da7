"""ORS at the origin root, driven by openreward 0.1.167's own client (`AsyncOpenReward`, unmodified, in
its own venv) against a real `sparring serve` on loopback: the Task API equal to `dataset build`, the
pack's tools, the outputs of `POST /tools/<name>`, the grader's reward from the terminal tool, and a
call after it refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REDIS_URL, TOOLS_KEY
from tests.episodes.conftest import gold_answer
from tests.episodes.openreward_client import drive, ensure_venv
from tests.system.helpers import Server
from tests.system.test_openenv import (  # noqa: F401 (module fixtures)
    TOOLS,
    gold_calls_and_a_mistake,
    replayed,
    retail_dir,
    retail_server,
    test_rows,
    write_task,
)

pytestmark = pytest.mark.slow

KEY = {"api_key": TOOLS_KEY}


@pytest.fixture(scope="module")
def client_python() -> Path:
    return ensure_venv()


@pytest.fixture(scope="module", params=["redis", "memory"])
async def server(
    request: pytest.FixtureRequest,
    module_database: str,
    retail_dir: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Server]:
    """One server per state backend (Redis, or the embedded in-memory store)."""
    redis_url = REDIS_URL if request.param == "redis" else None
    async with retail_server(
        "openreward", module_database, redis_url, retail_dir, tmp_path_factory
    ) as served:
        yield served


@pytest.fixture
async def http(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as client:
        yield client


async def test_the_task_api_and_the_tools_as_openreward_gives_them(
    server: Server,
    http: httpx.AsyncClient,
    client_python: Path,
    test_rows: list[dict[str, Any]],  # noqa: F811
) -> None:
    found = await drive(client_python, "tasks", server.url, KEY)
    assert found["tasks"] == test_rows and found["env_names"] == ["retail"]
    assert found["num_tasks"] == len(test_rows) and "test" in found["splits"]
    assert found["third"] == test_rows[3] and found["range"] == test_rows[2:5]
    served = (await http.get("/tools", headers=TOOLS)).json()
    expected = [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in served
    ]
    assert found["tools"] == expected and len(expected) == 15
    assert found["terminal"] == {"name": "submit", "arg": "answer"}


async def test_gold_calls_and_the_answer_score_one_and_a_call_after_is_refused(
    server: Server,
    http: httpx.AsyncClient,
    client_python: Path,
    test_rows: list[dict[str, Any]],  # noqa: F811
) -> None:
    index, row = write_task(test_rows, (await http.get("/tools", headers=TOOLS)).json())
    calls = gold_calls_and_a_mistake(row)
    episode = await drive(
        client_python, "episode", server.url, KEY, index=index, calls=calls, answer=gold_answer(row)
    )
    assert [o["texts"] for o in episode["outputs"]] == [[out] for out in await replayed(http, calls)]
    assert [o["metadata"]["is_error"] for o in episode["outputs"]] == [n == 1 for n in range(len(calls))]
    assert all(o["finished"] is False for o in episode["outputs"])
    assert episode["submitted"]["reward"] == 1.0 and episode["submitted"]["finished"] is True
    assert episode["after_submit"]["reason"] == "episode_finished", episode["after_submit"]
    assert episode["prompt"] == [m["content"] for m in row["messages"]]


async def test_a_wrong_answer_scores_zero(
    server: Server,
    http: httpx.AsyncClient,
    client_python: Path,
    test_rows: list[dict[str, Any]],  # noqa: F811
) -> None:
    index, _ = write_task(test_rows, (await http.get("/tools", headers=TOOLS)).json())
    lookup = [{"name": "list_all_product_types", "arguments": {}}]
    episode = await drive(
        client_python, "episode", server.url, KEY, index=index, calls=lookup, answer="I could not help."
    )
    assert episode["submitted"]["reward"] == 0.0 and episode["submitted"]["finished"] is True
    assert episode["after_submit"]["reason"] == "episode_finished"
