"""OpenEnv resets and hostile frames: a reset always starts a fresh rollout (`episode_id` is a label),
a reset refuses a task nested too deeply, and a non-string `session_id` is a JSON-RPC error."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from app.main import create_app
from app.rollouts.identity import JSON_DEPTH_MAX
from sparring.wire import CALL_ID_META
from tests.conftest import ADMIN_KEY, TOOLS_KEY, AppFactory, make_settings
from tests.packs import counter_pack
from tests.remote.served import serve

TOOLS = {"Authorization": f"Bearer {TOOLS_KEY}"}
ROW = {"task_id": "count-1", "messages": [{"role": "user", "content": "count"}]}


@pytest.fixture
def url(tmp_path: Path, backend_settings: dict[str, Any]) -> Iterator[str]:
    settings = make_settings(tmp_path / "home", **backend_settings)
    with serve(create_app(settings, packs=[counter_pack])) as base:
        yield base


@contextlib.asynccontextmanager
async def socket(url: str) -> AsyncIterator[ClientConnection]:
    async with ws_connect(
        url.replace("http://", "ws://") + "/openenv/counter/ws", additional_headers=TOOLS
    ) as ws:
        yield ws


async def frame(ws: ClientConnection, kind: str, data: Any = None) -> dict[str, Any]:
    await ws.send(orjson.dumps({"type": kind, "data": data or {}}).decode())
    answer: dict[str, Any] = orjson.loads(await ws.recv())
    return answer


async def step(ws: ClientConnection, tool: str, **arguments: Any) -> Any:
    answer = await frame(ws, "step", {"type": "call_tool", "tool_name": tool, "arguments": arguments})
    return orjson.loads(answer["data"]["observation"]["result"]["data"])


async def test_a_reset_with_an_earlier_episode_id_starts_a_fresh_rollout(url: str) -> None:
    async with socket(url) as first, socket(url) as second:
        traces = []
        for ws in (first, first, second):
            started = await frame(ws, "reset", {"task": ROW, "episode_id": "episode-001"})
            assert await step(ws, "read_counter") == {"value": 100}, "an earlier episode's state leaks"
            assert await step(ws, "increment", by=5) == {"value": 105}
            trace = started["data"]["metadata"]["trace_id"]
            assert (await frame(ws, "state"))["data"]["episode_id"] == trace
            traces.append(trace)
        ended = {"type": "call_tool", "tool_name": "submit", "arguments": {"answer": "Done."}}
        assert (await frame(first, "step", ended))["data"]["done"] is True
        await frame(first, "reset", {"task": ROW, "episode_id": "episode-001"})
        assert await step(first, "increment", by=1) == {"value": 101}
    assert len(set(traces)) == 3 and all(t.startswith("trace_openenv_episode-001_") for t in traces)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as http:
        found = (await http.get("/rollouts", params={"q": "episode-001"})).json()
    assert set(traces) <= {rollout["trace_id"] for rollout in found["rollouts"]}


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_a_reset_refuses_a_task_nested_too_deeply(url: str) -> None:
    deep: Any = "x"
    for _ in range(JSON_DEPTH_MAX - 1):  # in the row: as deep as it may nest
        deep = [deep]
    async with socket(url) as ws:
        for extra in ([deep], [[[deep]]] * 100):
            refused = await frame(ws, "reset", {"task": {**ROW, "extra": extra}})
            assert refused["type"] == "error" and refused["data"]["code"] == "VALIDATION_ERROR", refused
            assert "nests" in refused["data"]["message"]
        assert (await frame(ws, "reset", {"task": {**ROW, "extra": deep}}))["type"] == "observation"
        assert await step(ws, "read_counter") == {"value": 100}


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_a_frame_past_the_body_limit_is_refused_and_the_socket_goes_on(
    tmp_path: Path, backend_settings: dict[str, Any]
) -> None:
    # Over HTTP such a body is a 413; a row as large would be kept in the session and read every step.
    settings = make_settings(tmp_path / "home", max_body_bytes=8192, **backend_settings)
    with serve(create_app(settings, packs=[counter_pack])) as url:
        async with socket(url) as ws:
            large = {**ROW, "extra": "x" * 10_000}
            refused = await frame(ws, "reset", {"task": large})
            assert refused["type"] == "error" and refused["data"]["code"] == "VALIDATION_ERROR", refused
            assert "SPARRING_MAX_BODY_BYTES (8192 bytes)" in refused["data"]["message"]
            assert (await frame(ws, "reset", {"task": ROW}))["type"] == "observation"
            assert await step(ws, "increment", by=2) == {"value": 102}


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
@pytest.mark.parametrize("session_id", [5, 1.5, True, ["s"], {"id": "s"}])
async def test_a_non_string_session_id_is_invalid_params(app_factory: AppFactory, session_id: Any) -> None:
    async with app_factory(packs=[counter_pack]) as client:
        params = {"name": "read_counter", "arguments": {}, "session_id": session_id}
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}
        answer = await client.post("/openenv/counter/mcp", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["error"]["code"] == -32602


async def test_a_step_retried_under_the_clients_call_id_is_answered_from_the_ledger(url: str) -> None:
    """A step carries no id of its own: one retried after a `transport_error` (whose call may have been
    applied) runs again unless the client names it, in the action's `metadata["call_id"]` (WebSocket)
    or `_meta["sparring/call_id"]` (JSON-RPC), as `call_id` on the tool routes."""

    def increment(by: int, **extra: Any) -> dict[str, Any]:
        return {"type": "call_tool", "tool_name": "increment", "arguments": {"by": by}, **extra}

    async with httpx.AsyncClient(base_url=url, headers=TOOLS) as http:
        rpc = {"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create"}
        sid = (await http.post("/openenv/counter/mcp", json=rpc)).json()["result"]["session_id"]
        ws_url = url.replace("http://", "ws://") + f"/openenv/counter/ws?session_id={sid}"
        async with ws_connect(ws_url, additional_headers=TOOLS) as ws:
            await frame(ws, "reset", {"task": ROW})
            named = increment(5, metadata={"call_id": "c1"})
            outputs = [await frame(ws, "step", action) for action in (named, named, increment(1))]
            values = [orjson.loads(o["data"]["observation"]["result"]["data"]) for o in outputs]
            assert values == [{"value": 105}, {"value": 105}, {"value": 106}]
            refused = await frame(ws, "step", increment(1, metadata={"call_id": 7}))
            assert refused["type"] == "error" and refused["data"]["code"] == "VALIDATION_ERROR", refused

            async def call(meta: dict[str, Any]) -> dict[str, Any]:
                params = {"name": "increment", "arguments": {"by": 10}, "session_id": sid, "_meta": meta}
                body = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params}
                answer: dict[str, Any] = (await http.post("/openenv/counter/mcp", json=body)).json()
                return answer

            first, again = await call({CALL_ID_META: "c2"}), await call({CALL_ID_META: "c2"})
            assert first["result"] == again["result"] and "116" in orjson.dumps(first["result"]).decode()
            assert (await call({CALL_ID_META: ""}))["error"]["code"] == -32602
            assert await step(ws, "read_counter") == {"value": 116}, "each named call applied once"
