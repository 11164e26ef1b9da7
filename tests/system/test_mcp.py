"""MCP against real `sparring serve` processes on Postgres and Redis, with the retail pack and the
official client over Streamable HTTP: the same tools, the same answers, the same log as the routes."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import orjson
import pytest
from mcp import Client

from tests.conftest import ADMIN_KEY, REDIS_URL, new_trace
from tests.mcp.conftest import Sessions, mcp_client, text_of
from tests.retail.corpus import get_task, replay_calls, split_task_ids
from tests.system.helpers import ROOT, Server, Servers, server_settings
from tools.retail import data, pack
from tools.retail.tasks import ToolCall

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TASKS = 6  # train tasks replayed both ways


@pytest.fixture(scope="module")
def retail_dir() -> Path:
    return data.DATA.fetch(data.DATA.cache_dir(ROOT / ".sparring"))


def settings(database: str, home: Path, retail_dir: Path, worker: str) -> dict[str, str]:
    return server_settings(
        database_url=database,
        redis_url=REDIS_URL,
        home=home,
        worker=worker,
        SPARRING_PACKS="retail",
        SPARRING_RETAIL_DATA=str(retail_dir),
    )


@pytest.fixture
async def server(servers: Servers, module_database: str, retail_dir: Path, tmp_path: Path) -> Server:
    return await servers.start("a", settings(module_database, tmp_path / "a", retail_dir, "mcp-a"), cli=True)


@pytest.fixture
async def admin(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, headers=ADMIN, timeout=30.0) as client:
        yield client


def mutates(call: ToolCall) -> bool:
    return pack.tools[call[0]].mutates


def batches(calls: list[ToolCall]) -> list[list[int]]:
    """Call indexes grouped as a model sends them: a run of reads at once, each write alone."""
    groups: list[list[int]] = []
    for i, call in enumerate(calls):
        if groups and not mutates(call) and not mutates(calls[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


async def over_mcp(mcp: Client, calls: list[ToolCall]) -> list[tuple[str, bool]]:
    """(output, isError) of each call; a run of reads goes out at once, as parallel tool calls."""
    results: list[tuple[str, bool]] = []
    for group in batches(calls):
        answers = await asyncio.gather(*(mcp.call_tool(*calls[i]) for i in group))
        results += [(text_of(a), a.is_error) for a in answers]
    return results


async def over_http(client: httpx.AsyncClient, trace: str, calls: list[ToolCall]) -> list[str]:
    async def send(i: int) -> str:
        name, arguments = calls[i]
        body = {"call_id": f"call_{i}", "name": name, "arguments": orjson.dumps(arguments).decode()}
        r = await client.post("/tools", json={**body, "trace_id": trace})
        assert r.status_code == 200, r.text
        return str(r.json()["output"])

    outputs: list[str] = []
    for group in batches(calls):
        outputs += await asyncio.gather(*(send(i) for i in group))
    return outputs


async def changed(client: httpx.AsyncClient, trace: str) -> Any:
    r = await client.get(f"/rollouts/{trace}/state", params={"changed_only": "true"})
    assert r.status_code == 200, r.text
    return r.json()["packs"]


async def logged(client: httpx.AsyncClient, trace: str) -> dict[str, Any]:
    r = await client.get(f"/rollouts/{trace}")
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


async def test_tools_list_has_the_schemas_of_get_tools(server: Server, admin: httpx.AsyncClient) -> None:
    served = (await admin.get("/tools")).json()
    async with mcp_client(f"{server.url}/mcp") as mcp:
        listed = (await mcp.list_tools()).tools
    assert len(listed) == len(served) == 15
    assert [(t.name, t.description, t.input_schema) for t in listed] == [
        (t["name"], t["description"], t["parameters"]) for t in served
    ]
    writes = {t.name for t in listed if t.annotations and t.annotations.destructive_hint}
    assert writes == {t["name"] for t in served if t["mutates"]} and writes
    assert all(t.annotations and t.annotations.read_only_hint for t in listed if t.name not in writes)


async def test_gold_replays_end_with_the_database_of_the_http_route(
    server: Server, admin: httpx.AsyncClient
) -> None:
    for task_id in split_task_ids("train")[:TASKS]:
        calls = replay_calls(task_id)
        sessions = Sessions()
        async with mcp_client(f"{server.url}/mcp", sessions=sessions) as mcp:
            answers = await over_mcp(mcp, calls)
        http_trace = new_trace()
        outputs = await over_http(admin, http_trace, calls)

        assert [output for output, _ in answers] == outputs, task_id  # byte for byte
        assert [is_error for _, is_error in answers] == [o.startswith("Error: ") for o in outputs]
        mcp_trace = sessions.trace
        assert await changed(admin, mcp_trace) == await changed(admin, http_trace), task_id
        if any(mutates(call) for call in calls):
            assert await changed(admin, mcp_trace), f"task {task_id} changed nothing"

        # Every call answered is in the log, under the session's rollout, labelled production / mcp.
        rollout = await logged(admin, mcp_trace)
        assert (rollout["run"], rollout["channel"], rollout["call_count"]) == (
            "production",
            "mcp",
            len(calls),
        )
        assert sorted(c["output"] for c in rollout["timeline"]) == sorted(outputs)
        assert {c["channel"] for c in rollout["timeline"]} == {"mcp"}

        # A trainer that takes MCP servers grades the session's rollout like any other.
        answer = "Done. " + " and ".join(get_task(task_id).evaluation_criteria.communicate_info)
        graded = await admin.post(
            "/grade/retail",
            json={"sample": {"output_text": answer}, "item": {"task_id": task_id}, "trace_id": mcp_trace},
        )
        assert graded.status_code == 200, graded.text
        assert graded.json()["score"] == 1.0, (task_id, graded.json())


async def test_parallel_calls_in_one_session_are_all_answered_and_logged(
    server: Server, admin: httpx.AsyncClient, retail_dir: Path
) -> None:
    users = sorted(data.read_json(retail_dir, "db.json")["users"])[:4]
    sessions = Sessions()
    async with mcp_client(f"{server.url}/mcp", sessions=sessions) as mcp:
        results = await asyncio.gather(
            *(mcp.call_tool("get_user_details", {"user_id": u}) for u in users for _ in range(3))
        )
    answers = [text_of(r) for r in results]
    for i, user in enumerate(u for u in users for _ in range(3)):
        assert not results[i].is_error and orjson.loads(answers[i])["user_id"] == user
    rollout = await logged(admin, sessions.trace)
    assert rollout["call_count"] == len(results) == 12
    assert sorted(c["output"] for c in rollout["timeline"]) == sorted(answers)
    assert len({c["call_id"] for c in rollout["timeline"]}) == 12


async def test_two_sessions_are_two_isolated_rollouts(server: Server, admin: httpx.AsyncClient) -> None:
    calls = replay_calls(split_task_ids("train")[0])
    first_write = next(i for i, call in enumerate(calls) if mutates(call))
    name, arguments = calls[first_write]
    order = {"order_id": arguments["order_id"]}
    one, two = Sessions(), Sessions()
    async with (
        mcp_client(f"{server.url}/mcp", sessions=one) as a,
        mcp_client(f"{server.url}/mcp", sessions=two) as b,
    ):
        before = text_of(await b.call_tool("get_order_details", order))
        written = await a.call_tool(name, arguments)
        assert not written.is_error, text_of(written)
        seen_by_a = text_of(await a.call_tool("get_order_details", order))
        seen_by_b = text_of(await b.call_tool("get_order_details", order))
    assert seen_by_a != before and orjson.loads(seen_by_a)["status"] == "exchange requested"
    assert seen_by_b == before
    assert one.trace != two.trace
    assert await changed(admin, two.trace) == {"retail": {"changed": {}}}  # read, changed nothing
    assert (await logged(admin, one.trace))["call_count"] == 2


class Alternating(httpx2.AsyncBaseTransport):
    """Sends each request to the next of several servers: every call of a session meets another replica."""

    def __init__(self, ports: list[int]) -> None:
        self.inner = httpx2.AsyncHTTPTransport()
        self.ports = itertools.cycle(ports)
        self.sent: list[int] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        port = next(self.ports)
        self.sent.append(port)
        request.url = request.url.copy_with(port=port)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_any_replica_answers_any_request_of_a_session(
    servers: Servers,
    server: Server,
    admin: httpx.AsyncClient,
    module_database: str,
    retail_dir: Path,
    tmp_path: Path,
) -> None:
    other = await servers.start("b", settings(module_database, tmp_path / "b", retail_dir, "mcp-b"), cli=True)
    task_id = split_task_ids("train")[1]
    calls = replay_calls(task_id)
    transport = Alternating([server.port, other.port])
    sessions = Sessions()
    async with mcp_client(f"{server.url}/mcp", transport=transport, sessions=sessions) as mcp:
        answers = await over_mcp(mcp, calls)
        # A replica restarted mid-conversation: the session goes on, on both replicas.
        other.stop()
        other = await servers.start("b2", {**other.settings, "SPARRING_WORKER_NAME": "mcp-b2"}, cli=True)
        transport.ports = itertools.cycle([server.port, other.port])
        after = [await mcp.call_tool("list_all_product_types", {}) for _ in range(2)]
    http_trace = new_trace()
    outputs = await over_http(admin, http_trace, calls)
    assert [o for o, _ in answers] == outputs
    assert not any(r.is_error for r in after)
    rollout = await logged(admin, sessions.trace)
    assert {c["worker"] for c in rollout["timeline"]} == {"mcp-a", "mcp-b", "mcp-b2"}
    assert rollout["call_count"] == len(calls) + 2
    assert await changed(admin, sessions.trace) == await changed(admin, http_trace)
