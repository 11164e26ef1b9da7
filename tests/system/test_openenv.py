"""OpenEnv at `<base>/openenv/retail`, driven by openenv 0.10.0's own clients (`MCPToolClient`,
`GenericEnvClient`, unmodified, in their own venv) against a real `sparring serve` on loopback, on
Postgres with Redis and with the in-memory store: the tools, the outputs of `POST /tools/<name>`, one
rollout per episode, the pack grader's reward on `submit`, and the Task API equal to `dataset build`."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.conftest import ADMIN_KEY, GRADER_KEY, REDIS_URL, TOOLS_KEY, new_trace
from tests.episodes.conftest import gold_answer
from tests.episodes.openenv_client import drive, ensure_venv
from tests.system.helpers import ROOT, Server, Servers, ThrowawayRedis, clean_env, server_settings
from tools.retail import data
from tools.retail.tasks import calls_from_actions

pytestmark = pytest.mark.slow

TOOLS = {"Authorization": f"Bearer {TOOLS_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
GRADER = {"Authorization": f"Bearer {GRADER_KEY}"}
MOUNT = "/openenv/retail"


@pytest.fixture(scope="module")
def retail_dir() -> Path:
    return data.DATA.fetch(data.DATA.cache_dir(ROOT / ".sparring"))


@pytest.fixture(scope="module")
def client_python() -> Path:
    return ensure_venv()


@pytest.fixture(scope="module")
def test_rows(retail_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """`sparring dataset build retail --split test`, as the command writes it."""
    out = tmp_path_factory.mktemp("dataset") / "test.jsonl"
    sparring = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "sparring"
    if not sparring.exists():
        sparring = ROOT / ".venv" / "bin" / "sparring"
    env = clean_env(SPARRING_PACKS="retail", SPARRING_RETAIL_DATA=str(retail_dir))
    command = [str(sparring), "dataset", "build", "retail", "--split", "test", "--out", str(out)]
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    return [orjson.loads(line) for line in out.read_bytes().splitlines() if line.strip()]


@pytest.fixture(scope="module", params=["redis", "memory"])
async def server(
    request: pytest.FixtureRequest,
    module_database: str,
    retail_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Server]:
    """One server per state backend (Redis, or the embedded in-memory store); the tests isolate by
    trace: every episode is a fresh rollout, every session a fresh record."""
    redis_url = REDIS_URL if request.param == "redis" else None
    async with retail_server("openenv", module_database, redis_url, retail_dir, tmp_path_factory) as served:
        yield served


@asynccontextmanager
async def retail_server(
    name: str,
    database_url: str,
    redis_url: str | None,
    retail_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Server]:
    """`sparring serve` with the retail pack, as users start it, on the given backends."""
    home = tmp_path_factory.mktemp(name)
    settings = server_settings(
        database_url=database_url,
        redis_url=redis_url,
        home=home / "home",
        worker=f"{name}-a",
        SPARRING_PACKS="retail",
        SPARRING_RETAIL_DATA=str(retail_dir),
    )
    servers = Servers(home)
    try:
        yield await servers.start("a", settings, cli=True)
    finally:
        servers.stop_all()


@pytest.fixture
async def http(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as client:
        yield client


def write_task(rows: list[dict[str, Any]], tools: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """The first test task whose gold calls change the database (a wrong episode cannot pass it)."""
    writes = {t["name"] for t in tools if t["mutates"]}
    for index, row in enumerate(rows):
        if any(action["name"] in writes for action in row["actions"]):
            return index, row
    raise AssertionError("no test task writes")


def gold_calls_and_a_mistake(row: dict[str, Any]) -> list[dict[str, Any]]:
    calls = [{"name": name, "arguments": args} for name, args in calls_from_actions(row["actions"])]
    calls.insert(1, {"name": calls[0]["name"], "arguments": {"no_such_argument": 1}})
    return calls


async def replayed(http: httpx.AsyncClient, calls: list[dict[str, Any]]) -> list[str]:
    """Each call's output from `POST /tools/<name>` on a fresh trace."""
    trace, outputs = new_trace(), []
    for number, call in enumerate(calls):
        body = {
            "type": "function_call",
            "call_id": f"c{number}",
            "arguments": call["arguments"],
            "trace_id": trace,
        }
        answer = await http.post(f"/tools/{call['name']}", json=body, headers=TOOLS)
        assert answer.status_code == 200, answer.text
        outputs.append(answer.json()["output"])
    return outputs


async def graded(http: httpx.AsyncClient, trace: str, row: dict[str, Any], answer: str) -> float:
    body = {"sample": {"output_text": answer}, "item": row, "trace_id": trace}
    answered = await http.post("/grade/retail", json=body, headers=GRADER)
    assert answered.status_code == 200, answered.text
    score: float = answered.json()["score"]
    return score


async def rollout(http: httpx.AsyncClient, trace: str) -> dict[str, Any]:
    answered = await http.get(f"/rollouts/{trace}", headers=ADMIN)
    assert answered.status_code == 200, answered.text
    found: dict[str, Any] = answered.json()
    return found


async def test_the_mount_answers_and_refuses_a_missing_or_wrong_key(
    server: Server, http: httpx.AsyncClient, client_python: Path
) -> None:
    base = server.url + MOUNT
    assert (await http.get(f"{MOUNT}/health")).json() == {"status": "healthy"}
    assert (await http.get("/openenv/nope/health")).status_code == 404
    described = await http.get(f"{MOUNT}/metadata", headers=TOOLS)
    assert described.json()["name"] == "retail" and "submit" in described.json()["description"]
    assert set((await http.get(f"{MOUNT}/schema", headers=TOOLS)).json()) == {
        "action",
        "observation",
        "state",
    }
    assert (await http.get(f"{MOUNT}/metadata")).status_code == 401
    rpc = {"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 1}
    assert (await http.post(f"{MOUNT}/mcp", json=rpc)).status_code == 401
    assert (
        await http.post(f"{MOUNT}/mcp", json=rpc, headers={"Authorization": "Bearer nope"})
    ).status_code == 401
    listed = await http.post(f"{MOUNT}/mcp", json=rpc, headers=TOOLS)
    assert listed.status_code == 200 and listed.json()["result"]["tools"]

    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        refused = await drive(client_python, "refused", base, headers)
        assert refused["ws"].startswith("ConnectionError") and "403" in refused["ws"], refused
        assert "401" in refused["mcp"], refused
    accepted = await drive(client_python, "refused", base, TOOLS)
    assert accepted["ws"] == "accepted", accepted


async def test_the_task_api_under_the_mount_is_dataset_build(
    http: httpx.AsyncClient, test_rows: list[dict[str, Any]]
) -> None:
    split = {"split": "test"}
    assert (await http.get(f"{MOUNT}/list_environments", headers=TOOLS)).json() == ["retail"]
    tasks = await http.post(f"{MOUNT}/retail/tasks", json=split, headers=TOOLS)
    assert tasks.json() == {"tasks": test_rows, "env_name": "retail"}
    count = await http.post(f"{MOUNT}/retail/num_tasks", json=split, headers=TOOLS)
    assert count.json() == {"num_tasks": len(test_rows)}
    third = await http.post(f"{MOUNT}/retail/task", json={**split, "index": 3}, headers=TOOLS)
    assert third.json() == {"task": test_rows[3], "env_name": "retail"}
    ranged = await http.post(
        f"{MOUNT}/retail/task_range", json={**split, "start": 2, "stop": 5}, headers=TOOLS
    )
    assert ranged.json()["tasks"] == test_rows[2:5]
    bad = await http.post(f"{MOUNT}/retail/tasks", json={"split": "nope"}, headers=TOOLS)
    assert (bad.status_code, bad.json()) == (400, {"detail": "Invalid split"})
    assert (await http.post(f"{MOUNT}/retail/tasks", json=split)).status_code == 401


async def test_both_clients_list_exactly_the_packs_tools(
    server: Server, http: httpx.AsyncClient, client_python: Path
) -> None:
    served = (await http.get("/tools", headers=TOOLS)).json()
    expected = [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in served
    ]
    listed = await drive(client_python, "list_tools", server.url + MOUNT, TOOLS)
    assert listed["mcp"] == expected and listed["ws"] == expected and len(expected) == 15
    assert listed["ws_done"] is False and isinstance(listed["ws_meta"], dict)
    assert "submit" not in {t["name"] for t in listed["mcp"]}


async def test_an_episode_over_mcp_is_one_rollout_with_the_routes_outputs_and_the_graders_reward(
    server: Server, http: httpx.AsyncClient, client_python: Path, test_rows: list[dict[str, Any]]
) -> None:
    index, row = write_task(test_rows, (await http.get("/tools", headers=TOOLS)).json())
    calls, answer = gold_calls_and_a_mistake(row), gold_answer(row)
    headers = {**TOOLS, "X-Sparring-Run": "openenv-acceptance"}
    episode = await drive(
        client_python,
        "mcp_episode",
        server.url + MOUNT,
        headers,
        reset={"split": "test", "index": index},
        calls=calls,
        answer=answer,
    )
    assert episode["reset"]["messages"] == row["messages"] and episode["reset"]["task_id"] == row["task_id"]
    assert episode["outputs"] == await replayed(http, calls)
    assert episode["outputs"][1].startswith("Error: ")
    trace = episode["episode_id"]
    assert trace.startswith("trace_openenv_") and episode["step_count"] == len(calls)

    assert episode["done"] is True and episode["reward"] == 1.0
    assert episode["reward"] == await graded(http, trace, row, answer)
    assert episode["submit_result"]["structured_content"] == {"reward": 1.0, "done": True}
    assert "finished" in episode["after_submit"] or "ended" in episode["after_submit"], episode[
        "after_submit"
    ]
    assert episode["after_submit"].startswith("RuntimeError")

    logged = await rollout(http, trace)
    assert [c["tool"] for c in logged["timeline"]] == [c["name"] for c in calls]
    assert {c["channel"] for c in logged["timeline"]} == {"openenv"}
    assert logged["run"] == "openenv-acceptance"


async def test_an_episode_over_the_websocket_steps_submits_and_refuses_a_call_after(
    server: Server, http: httpx.AsyncClient, client_python: Path, test_rows: list[dict[str, Any]]
) -> None:
    _, row = write_task(test_rows, (await http.get("/tools", headers=TOOLS)).json())
    calls, answer = gold_calls_and_a_mistake(row), gold_answer(row)
    base = server.url + MOUNT
    episode = await drive(
        client_python, "ws_episode", base, TOOLS, reset={"task": row}, calls=calls, answer=answer
    )
    results = [step["observation"]["result"] for step in episode["steps"]]
    assert [r["data"] for r in results] == await replayed(http, calls)
    assert [r["is_error"] for r in results] == [n == 1 for n in range(len(calls))]
    assert [r["content"] for r in results] == [[{"type": "text", "text": r["data"]}] for r in results]
    assert all(step["observation"]["error"] is None and step["done"] is False for step in episode["steps"])
    trace = episode["state"]["episode_id"]
    assert [step["metadata"]["trace_id"] for step in episode["steps"]] == [trace] * len(calls)
    assert episode["state"]["step_count"] == len(calls) and episode["state"]["done"] is False

    assert episode["done"] is True and episode["reward"] == 1.0
    assert episode["reward"] == await graded(http, trace, row, answer)
    assert episode["after_submit"].startswith("RuntimeError") and "SESSION_ERROR" in episode["after_submit"]

    logged = await rollout(http, trace)
    assert [c["tool"] for c in logged["timeline"]] == [c["name"] for c in calls]
    assert {c["channel"] for c in logged["timeline"]} == {"openenv"} and logged["run"] == "openenv"

    again = await drive(
        client_python, "ws_episode", base, TOOLS, reset={"task": row}, calls=calls[:1], answer="x"
    )
    assert again["state"]["episode_id"] != trace


async def test_one_lookup_and_a_wrong_answer_score_zero(
    server: Server, http: httpx.AsyncClient, client_python: Path, test_rows: list[dict[str, Any]]
) -> None:
    index, row = write_task(test_rows, (await http.get("/tools", headers=TOOLS)).json())
    lookup = [{"name": "list_all_product_types", "arguments": {}}]
    wrong = "I could not help, sorry."
    episode = await drive(
        client_python,
        "ws_episode",
        server.url + MOUNT,
        TOOLS,
        reset={"split": "test", "index": index},
        calls=lookup,
        answer=wrong,
    )
    assert episode["done"] is True and episode["reward"] == 0.0
    assert episode["reward"] == await graded(http, episode["state"]["episode_id"], row, wrong)


# --- the wire itself: error frames, JSON-RPC errors, one session over both transports -------------


async def frame(socket: ClientConnection, kind: str, data: Any = None) -> dict[str, Any]:
    await socket.send(orjson.dumps({"type": kind, "data": data or {}}).decode())
    answer: dict[str, Any] = orjson.loads(await socket.recv())
    return answer


async def rpc(http: httpx.AsyncClient, method: str, **params: Any) -> dict[str, Any]:
    body = {"jsonrpc": "2.0", "method": method, "params": params, "id": 7}
    answered = await http.post(f"{MOUNT}/mcp", json=body, headers=TOOLS)
    assert answered.status_code == 200, answered.text
    found: dict[str, Any] = answered.json()
    return found


def ws_url(server: Server, query: str = "") -> str:
    return f"ws://127.0.0.1:{server.port}{MOUNT}/ws{query}"


async def test_bad_frames_get_error_frames_with_openenvs_codes(server: Server) -> None:
    async with ws_connect(ws_url(server), additional_headers=TOOLS) as socket:
        await socket.send("not json")
        assert orjson.loads(await socket.recv())["data"]["code"] == "INVALID_JSON"
        assert (await frame(socket, "dance"))["data"]["code"] == "UNKNOWN_TYPE"
        assert (await frame(socket, "state"))["data"]["episode_id"] is None
        early = await frame(socket, "step", {"type": "call_tool", "tool_name": "list_all_product_types"})
        assert early["type"] == "error" and early["data"]["code"] == "SESSION_ERROR"
        assert (await frame(socket, "reset"))["data"]["code"] == "VALIDATION_ERROR"
        bad_index = await frame(socket, "reset", {"split": "test", "index": 10_000})
        assert bad_index["data"] == {"message": "Invalid index", "code": "VALIDATION_ERROR"}
        assert (await frame(socket, "reset", {"split": "nope", "index": 0}))["data"][
            "message"
        ] == "Invalid split"
        assert (await frame(socket, "step", {"code": "x"}))["data"]["code"] == "VALIDATION_ERROR"

        started = await frame(socket, "reset", {"split": "test", "index": 0, "episode_id": new_trace()})
        assert started["type"] == "observation" and started["data"]["done"] is False
        no_answer = await frame(socket, "step", {"type": "call_tool", "tool_name": "submit", "arguments": {}})
        result = no_answer["data"]["observation"]["result"]
        assert (
            result["is_error"] and result["data"].startswith("Error: ") and no_answer["data"]["done"] is False
        )
        await socket.send(orjson.dumps({"type": "close"}).decode())
        with pytest.raises(ConnectionClosed):
            await socket.recv()


async def test_json_rpc_errors_and_an_unknown_session(server: Server, http: httpx.AsyncClient) -> None:
    parse = await http.post(f"{MOUNT}/mcp", content=b"{", headers=TOOLS)
    assert parse.json()["error"]["code"] == -32700
    assert (await rpc(http, "initialize"))["error"]["code"] == -32601
    assert (await rpc(http, "tools/call", name="list_all_product_types"))["error"]["code"] == -32000
    created = (await rpc(http, "openenv/session/create"))["result"]["session_id"]
    before_reset = await rpc(http, "tools/call", name="list_all_product_types", session_id=created)
    assert "reset" in before_reset["error"]["message"]
    closed = await rpc(http, "openenv/session/close", session_id=created)
    assert closed["result"] == {"session_id": created, "closed": True}
    with pytest.raises(InvalidStatus) as refused:
        async with ws_connect(ws_url(server, f"?session_id={created}"), additional_headers=TOOLS):
            pass
    assert refused.value.response.status_code == 403
    grader = {"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 1}
    assert (await http.post(f"{MOUNT}/mcp", json=grader, headers=GRADER)).status_code == 403


async def test_the_socket_and_mcp_of_one_session_drive_one_rollout(
    server: Server, http: httpx.AsyncClient, test_rows: list[dict[str, Any]]
) -> None:
    sid = (await rpc(http, "openenv/session/create"))["result"]["session_id"]
    async with ws_connect(ws_url(server, f"?session_id={sid}"), additional_headers=TOOLS) as socket:
        trace = (await frame(socket, "reset", {"task": test_rows[0]}))["data"]["metadata"]["trace_id"]
        called = await rpc(http, "tools/call", name="list_all_product_types", arguments={}, session_id=sid)
        assert called["result"]["is_error"] is False
        submitted = await rpc(http, "tools/call", name="submit", arguments={"answer": "nope"}, session_id=sid)
        assert submitted["result"]["structured_content"] == {"reward": 0.0, "done": True}
        state = (await frame(socket, "state"))["data"]
        assert state == {"episode_id": trace, "step_count": 1, "trace_id": trace, "done": True, "reward": 0.0}
        after = await frame(socket, "step", {"type": "call_tool", "tool_name": "list_all_product_types"})
        assert after["type"] == "error" and "submit" in after["data"]["message"]
    logged = await rollout(http, trace)
    assert [(c["tool"], c["channel"]) for c in logged["timeline"]] == [("list_all_product_types", "openenv")]


async def test_a_redis_outage_is_a_503_over_mcp_and_an_error_mid_episode(
    servers: Servers, module_database: str, retail_dir: Path, tmp_path: Path, test_rows: list[dict[str, Any]]
) -> None:
    redis = ThrowawayRedis()
    await asyncio.to_thread(redis.start)
    try:
        settings = server_settings(
            database_url=module_database,
            redis_url=redis.url,
            home=tmp_path / "home",
            worker="openenv-outage",
            SPARRING_PACKS="retail",
            SPARRING_RETAIL_DATA=str(retail_dir),
        )
        server = await servers.start("outage", settings, cli=True)
        call = {"type": "call_tool", "tool_name": "list_all_product_types", "arguments": {}}
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=60.0) as http,
            ws_connect(ws_url(server), additional_headers=TOOLS) as socket,
        ):
            sid = (await rpc(http, "openenv/session/create"))["result"]["session_id"]
            await frame(socket, "reset", {"task": test_rows[0]})
            await asyncio.to_thread(redis.stop)

            down = await frame(socket, "step", call)
            assert down["type"] == "error" and down["data"]["code"] == "EXECUTION_ERROR", down
            assert "internal error" not in down["data"]["message"]
            body = {"jsonrpc": "2.0", "method": "tools/call", "id": 1}
            body["params"] = {"name": "list_all_product_types", "arguments": {}, "session_id": sid}
            unavailable = await http.post(f"{MOUNT}/mcp", json=body, headers=TOOLS)
            assert unavailable.status_code == 503 and unavailable.headers["Retry-After"]

            await asyncio.to_thread(redis.start)
            back = await frame(socket, "step", call)
            assert (
                back["type"] == "observation" and back["data"]["observation"]["result"]["is_error"] is False
            )
    finally:
        await asyncio.to_thread(redis.cleanup)
