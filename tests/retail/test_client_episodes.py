"""`sparring.client` end to end against a served retail pack (Postgres + Redis), sync and async."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from app.main import create_app
from sparring.client import AsyncEnvironment, Environment, GradeFailed, ToolCallFailed
from sparring.http import Retry
from tests.conftest import ADMIN_KEY, GRADER_KEY, REDIS_URL, TOOLS_KEY, make_settings
from tests.remote.model_server import ModelServer, Turn
from tests.remote.served import serve
from tests.retail.corpus import build_dataset, replay_calls
from tests.retail.gold import gold_turns
from tools.retail import pack

REPO = Path(__file__).resolve().parents[2]
FAST = Retry(attempts=3, delay_s=0.01, max_delay_s=0.05)


@pytest.fixture(scope="module")
def lines() -> list[dict[str, Any]]:
    return build_dataset("train")[:3]


@pytest.fixture(scope="module")
def model(lines: list[dict[str, Any]]) -> Iterator[ModelServer]:
    server = ModelServer()
    for line in lines:
        server.scripts[f"gold-{line['task_id']}"] = gold_turns(str(line["task_id"]))
    server.scripts["quitter"] = [Turn(text="Sorry, no.")]
    server.start()
    yield server
    server.stop()


@pytest.fixture
def sparring_url(tmp_path: Path, pg_database: str, retail_data: Path) -> Iterator[str]:
    settings = make_settings(tmp_path / "home", database_url=pg_database, redis_url=REDIS_URL)
    with serve(create_app(settings, packs=[pack], pack_settings={"retail": {"data": retail_data}})) as url:
        yield url


def test_the_client_imports_none_of_the_server_stack() -> None:
    """None of the server's stack is imported: a trainer's process loads only the runner's client side
    (httpx and openai)."""
    blocked = [
        "fastapi", "starlette", "sqlalchemy", "redis", "asyncpg", "aiosqlite", "alembic", "uvicorn",
        "typer", "pydantic_settings", "yaml", "rapidfuzz", "nltk", "prometheus_client", "jinja2",
        "aiohttp", "orjson",
    ]  # fmt: skip
    script = f"""
import sys
BLOCKED = {blocked!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("blocked: " + name)
        return None
sys.meta_path.insert(0, Block())
import sparring.client
from sparring.client import Environment, AsyncEnvironment, Episode
print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_sync_episodes_play_gold_to_reward_one_and_are_logged(
    sparring_url: str, model: ModelServer, lines: list[dict[str, Any]]
) -> None:
    with Environment(sparring_url, TOOLS_KEY, grader_key=GRADER_KEY, run="client-sync") as env:
        tools = env.tools(pack="retail")
        assert {t["function"]["name"] for t in tools} == set(pack.tools)
        assert tools == pack_tools()
        for line in lines:
            episode = env.run_episode(
                OpenAI(base_url=model.base_url(), api_key="x"), line, model=f"gold-{line['task_id']}",
                grader="retail",
            )  # fmt: skip
            assert episode.discarded is None
            assert episode.reward == 1.0
            gold = replay_calls(str(line["task_id"]))
            assert sorted(c["name"] for c in episode.tool_calls) == sorted(name for name, _ in gold)
            assert episode.messages[0]["role"] == "system"  # the chat view of the developer message
            assert episode.messages[-1] == {"role": "assistant", "content": episode.final_text}
        quitter = env.run_episode(OpenAI(base_url=model.base_url(), api_key="x"), lines[0], model="quitter",
                                  grader="retail")  # fmt: skip
        assert quitter.reward == 0.0 and quitter.tool_calls == []
    logged = httpx.get(
        f"{sparring_url}/rollouts/{episode.trace_id}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ).json()
    assert len(logged["timeline"]) == len(episode.tool_calls)
    assert logged["run"] == "client-sync" and logged["graded_at"] is not None
    # The episode's conversation is kept beside its calls (the grader key stores it).
    transcript = logged["transcript"]
    assert transcript["model"] == f"gold-{lines[-1]['task_id']}" and transcript["source"] == "client"
    assert [m["role"] for m in transcript["messages"]] == [m["role"] for m in episode.messages]
    asked = [
        c["call_id"] for m in transcript["messages"] if m["role"] == "assistant" for c in m["tool_calls"]
    ]
    assert sorted(asked) == sorted(c["call_id"] for c in logged["timeline"])


def pack_tools() -> list[dict[str, Any]]:
    return [spec.function_tool() for spec in pack.tools.values()]


async def test_async_episodes_in_parallel(
    sparring_url: str, model: ModelServer, lines: list[dict[str, Any]]
) -> None:
    async with AsyncEnvironment(sparring_url, TOOLS_KEY, grader_key=GRADER_KEY, run="client-async") as env:
        model_client = AsyncOpenAI(base_url=model.base_url(), api_key="x")
        episodes = await asyncio.gather(
            *(
                env.run_episode(model_client, line, model=f"gold-{line['task_id']}", grader="retail")
                for line in lines
            )
        )
    assert [e.reward for e in episodes] == [1.0] * len(lines)
    assert len({e.trace_id for e in episodes}) == len(lines)


def test_a_rollout_context_owns_its_trace_and_parallel_calls_keep_their_order(
    sparring_url: str, lines: list[dict[str, Any]]
) -> None:
    line = lines[0]
    item = {k: v for k, v in line.items() if k != "tools"}
    gold = replay_calls(str(line["task_id"]))
    with Environment(sparring_url, TOOLS_KEY, grader_key=GRADER_KEY) as env:
        with env.rollout(item=item) as rollout:
            assert rollout.trace_id.startswith("trace_") and len(rollout.trace_id) == 38
            reads = [("get_product_details", {"product_id": p}) for p in ("8310926033", "1656367028")]
            outputs = rollout.call_many(reads)
            assert [json.loads(o)["product_id"] for o in outputs] == ["8310926033", "1656367028"]
            mistake = rollout.call("get_order_details", {"order_id": "#W0000000"})
            assert mistake.startswith("Error:")
            for name, arguments in gold:
                rollout.call(name, arguments)
            answer = "Done. " + " and ".join(line["communicate_info"])
            assert rollout.grade("retail", answer) == 1.0
        with env.rollout(item=item) as other:
            assert other.trace_id != rollout.trace_id
            assert other.grade("retail", answer) == 0.0  # nothing done in this rollout
        with pytest.raises(GradeFailed, match="no grader named"):
            env.grade("no-such-grader", "x", item)


class FlakyTransport(httpx.AsyncBaseTransport):
    """Answers 503 to the first `failures` tool calls, then passes requests on to the real server."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.seen = 0
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and "/tools/" in request.url.path:
            self.seen += 1
            if self.seen <= self.failures:
                return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {}})
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_calls_are_retried_with_the_same_call_id_then_fail_for_good(sparring_url: str) -> None:
    flaky = FlakyTransport(failures=2)
    async with (
        httpx.AsyncClient(transport=flaky) as http,
        AsyncEnvironment(sparring_url, TOOLS_KEY, retry=FAST, http=http) as env,
        env.rollout() as rollout,
    ):
        output = await rollout.call("get_product_details", {"product_id": "8310926033"}, call_id="call_r1")
        assert json.loads(output)["product_id"] == "8310926033"
        assert flaky.seen == 3
        logged = await http.get(
            f"{sparring_url}/rollouts/{rollout.trace_id}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
        assert [c["call_id"] for c in logged.json()["timeline"]] == ["call_r1"]

    down = FlakyTransport(failures=100)
    async with httpx.AsyncClient(transport=down) as http:
        env = AsyncEnvironment(sparring_url, TOOLS_KEY, retry=FAST, http=http)
        with pytest.raises(ToolCallFailed, match="HTTP 503 after 3 attempts"):
            await env.call("list_all_product_types", {}, trace_id="trace_down")
        assert down.seen == 3
