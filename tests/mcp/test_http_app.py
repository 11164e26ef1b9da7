"""/mcp in this process, on both backends: the official client sees the registry and the call service."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import orjson
import pytest
from mcp.shared.exceptions import MCPError

from app.deps import app_state
from app.mcp.server import CRASHED, UNAVAILABLE
from app.rollouts.identity import trace_key
from app.sdk import Pack
from tests.conftest import ADMIN_KEY, GRADER_KEY, TOOLS_KEY, AppFactory, call_body, new_trace
from tests.mcp.conftest import Sessions, in_process, mcp_client, rollout, text_of
from tests.packs import counter_pack, faults_pack

URL = "http://127.0.0.1/mcp"
RAW_HEADERS = {
    "Host": "127.0.0.1",
    "Accept": "application/json, text/event-stream",
    "Content-Type": "application/json",
    "MCP-Protocol-Version": "2025-11-25",
    "Authorization": f"Bearer {TOOLS_KEY}",
}


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


def tools_call(name: str, arguments: dict[str, Any], request_id: int = 1) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments},
    }


async def test_tools_list_is_the_registry(client: httpx.AsyncClient) -> None:
    served = {t["name"]: t for t in (await client.get("/tools")).json()}
    async with mcp_client(URL, transport=in_process(client.app)) as mcp:  # type: ignore[attr-defined]
        listed = (await mcp.list_tools()).tools
    assert [t.name for t in listed] == list(served)
    for tool in listed:
        expected = served[tool.name]
        assert tool.description == expected["description"]
        assert tool.input_schema == expected["parameters"]
        assert tool.annotations is not None
        assert tool.annotations.read_only_hint is (not expected["mutates"])
        assert tool.annotations.destructive_hint is expected["mutates"]


# Each call, with what the model reads, is sent both ways: over MCP and to POST /tools/{name}.
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("increment", {"by": 2}),
    ("read_counter", {}),
    ("increment", {"by": "lots"}),  # fails the schema
    ("refuse", {"reason": "order #W1 not found"}),  # ToolError
    ("made_up", {}),  # no such tool
    ("shapes", {"query": "q", "mode": "slow", "kind": "b", "tags": ["x"], "address": None, "limit": None}),
    ("increment", {"by": 3}),
    ("read_counter", {}),
]


async def test_outputs_and_log_are_those_of_the_tool_routes(client: httpx.AsyncClient) -> None:
    sessions = Sessions()
    async with mcp_client(URL, transport=in_process(client.app), sessions=sessions) as mcp:  # type: ignore[attr-defined]
        results = [await mcp.call_tool(name, arguments) for name, arguments in CALLS]
    http_trace = new_trace()
    outputs = []
    for i, (name, arguments) in enumerate(CALLS):
        r = await client.post(
            f"/tools/{name}",
            json=call_body(orjson.dumps(arguments).decode(), trace_id=http_trace, call_id=f"c{i}"),
        )
        assert r.status_code == 200
        outputs.append(r.json()["output"])

    assert [text_of(r) for r in results] == outputs  # byte for byte
    assert [r.is_error for r in results] == [o.startswith("Error: ") for o in outputs]
    assert [r.is_error for r in results] == [False, False, True, True, True, False, False, False]
    assert orjson.loads(outputs[-1]) == {"value": 105}

    logged = await rollout(client, sessions.trace)
    assert logged["run"] == "production" and logged["channel"] == "mcp"
    assert [(c["tool"], c["output"], c["channel"]) for c in logged["timeline"]] == [
        (name, output, "mcp") for (name, _), output in zip(CALLS, outputs, strict=True)
    ]
    assert [c["outcome"] for c in logged["timeline"]] == [
        "model_error" if r.is_error else "ok" for r in results
    ]
    http_logged = await rollout(client, http_trace)
    assert http_logged["channel"] == "rft" and {c["channel"] for c in http_logged["timeline"]} == {"rft"}


async def test_trace_and_run_come_from_headers(client: httpx.AsyncClient) -> None:
    trace = new_trace()
    headers = {"X-Sparring-Trace-Id": trace, "X-Sparring-Run": "canary-7"}
    async with mcp_client(URL, transport=in_process(client.app), headers=headers) as mcp:  # type: ignore[attr-defined]
        await mcp.call_tool("increment", {"by": 1})
    # A production conversation keyed by its own id goes on over HTTP, in the same rollout.
    r = await client.post("/tools/increment", json=call_body('{"by": 1}', trace_id=trace, call_id="http_1"))
    assert r.json()["output"] == '{"value":102}'
    logged = await rollout(client, trace)
    assert logged["run"] == "canary-7" and logged["channel"] == "mcp"
    assert [c["channel"] for c in logged["timeline"]] == ["mcp", "rft"]


async def test_a_long_trace_id_is_the_same_rollout_over_the_tool_routes(client: httpx.AsyncClient) -> None:
    # Longer than the column: cut with a hash once, as the tool routes and the graders cut it.
    trace = new_trace() + "_" + "x" * 200
    headers = {"X-Sparring-Trace-Id": trace}
    async with mcp_client(URL, transport=in_process(client.app), headers=headers) as mcp:  # type: ignore[attr-defined]
        assert text_of(await mcp.call_tool("increment", {"by": 1})) == '{"value":101}'
    r = await client.post("/tools/increment", json=call_body('{"by": 1}', trace_id=trace, call_id="http_1"))
    assert r.json()["output"] == '{"value":102}'
    logged = await rollout(client, trace_key(trace))  # the key the log names it by
    assert [c["channel"] for c in logged["timeline"]] == ["mcp", "rft"]


async def test_arguments_with_an_integer_beyond_64_bits_are_logged(client: httpx.AsyncClient) -> None:
    # MCP sends arguments as an object, never as the string the tool routes log as sent: a number no
    # 64-bit integer holds (a long order id written as a number) is still the model's arguments.
    trace = new_trace()
    arguments = {"by": 1, "order": 12345678901234567890123}
    async with mcp_client(
        URL, transport=in_process(client.app), headers={"X-Sparring-Trace-Id": trace}
    ) as mcp:  # type: ignore[attr-defined]
        result = await mcp.call_tool("increment", arguments)
    assert result.is_error and "order: unexpected field" in text_of(result)
    [call] = (await rollout(client, trace))["timeline"]
    assert call["outcome"] == "model_error"
    assert json.loads(call["arguments"]) == arguments


async def test_a_crash_is_a_jsonrpc_error_and_logged(client: httpx.AsyncClient) -> None:
    trace = new_trace()
    headers = {"X-Sparring-Trace-Id": trace}
    async with mcp_client(URL, transport=in_process(client.app), headers=headers) as mcp:  # type: ignore[attr-defined]
        with pytest.raises(MCPError) as raised:
            await mcp.call_tool("crash", {})
    assert raised.value.code == CRASHED
    assert "RuntimeError" in raised.value.message and "boom" not in raised.value.message
    assert raised.value.data == {"code": "tool_crashed", "retryable": False}
    [call] = (await rollout(client, trace))["timeline"]
    assert (call["outcome"], call["status_code"], call["channel"]) == ("tool_crash", 500, "mcp")

    r = await client.post("/mcp", json=tools_call("crash", {}), headers=RAW_HEADERS)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == CRASHED


async def test_an_error_of_sparring_itself_is_a_500_without_its_text(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Neither a tool's crash nor an outage: the tool routes answer their generic 500 `internal_error`
    # (the exception's text, which may name hosts or data, goes to the server log only).
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("postgresql://admin:hunter2@db.internal/sparring")

    monkeypatch.setattr(app_state(client.app).call_service, "call", broken)  # type: ignore[attr-defined]
    r = await client.post("/tools/read_counter", json=call_body("{}", trace_id=new_trace(), call_id="c1"))
    assert r.status_code == 500 and "hunter2" not in r.text
    r = await client.post("/mcp", json=tools_call("read_counter", {}), headers=RAW_HEADERS)
    assert r.status_code == 500 and "hunter2" not in r.text
    error = r.json()["error"]
    assert error["code"] == CRASHED
    assert error["data"] == {"code": "internal_error", "retryable": False}


async def test_an_outage_is_a_retryable_jsonrpc_error(app_factory: AppFactory) -> None:
    # A one-slot call log under simultaneous calls sheds load, as the tool routes answer 503.
    async with app_factory(log_queue_size=1, log_batch_size=1) as client:
        async with mcp_client(URL, transport=in_process(client.app)) as mcp:  # type: ignore[attr-defined]
            results = await asyncio.gather(
                *(mcp.call_tool("read_counter", {}) for _ in range(40)), return_exceptions=True
            )
        errors = [r for r in results if isinstance(r, BaseException)]
        assert errors, "a one-slot log queue under 40 simultaneous calls must shed load"
        for error in errors:
            assert isinstance(error, MCPError), repr(error)
            assert error.code == UNAVAILABLE
            assert error.data["retryable"] is True and error.data["code"] == "call_log_unavailable"
        answered = [r for r in results if not isinstance(r, BaseException)]
        assert all(text_of(r) == '{"value":100}' and not r.is_error for r in answered)

        raw = await asyncio.gather(
            *(
                client.post("/mcp", json=tools_call("read_counter", {}, i), headers=RAW_HEADERS)
                for i in range(40)
            )
        )
        statuses = {r.status_code for r in raw}
        assert statuses <= {200, 503} and 503 in statuses
        for r in raw:
            if r.status_code == 503:
                assert r.headers["Retry-After"].isdigit()
                assert r.json()["error"]["code"] == UNAVAILABLE


async def test_keys_are_those_of_the_tool_routes(client: httpx.AsyncClient) -> None:
    for key in (None, "not-a-key"):
        with pytest.raises(BaseException) as raised:
            async with mcp_client(URL, key=key, transport=in_process(client.app)) as mcp:  # type: ignore[attr-defined]
                await mcp.list_tools()
        assert any(isinstance(e, MCPError) for e in leaves(raised.value)), repr(raised.value)
    transport = httpx.ASGITransport(app=client.app)  # type: ignore[attr-defined]
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as bare:
        for key, status in ((None, 401), ("not-a-key", 401), (GRADER_KEY, 403)):
            headers = {k: v for k, v in RAW_HEADERS.items() if k != "Authorization"}
            if key:
                headers["Authorization"] = f"Bearer {key}"
            r = await bare.post("/mcp", json=tools_call("read_counter", {}), headers=headers)
            assert r.status_code == status
            assert r.json()["error"]["code"] == ("unauthorized" if status == 401 else "forbidden")
    # The admin key passes everywhere, as on the tool routes.
    async with mcp_client(URL, key=ADMIN_KEY, transport=in_process(client.app)) as mcp:  # type: ignore[attr-defined]
        assert text_of(await mcp.call_tool("read_counter", {})) == '{"value":100}'


async def test_the_sessionless_protocol_is_refused_with_the_versions_served(
    client: httpx.AsyncClient,
) -> None:
    headers = {**RAW_HEADERS, "MCP-Protocol-Version": "2026-07-28"}
    r = await client.post(
        "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "server/discover"}, headers=headers
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == -32022
    assert error["data"]["requested"] == "2026-07-28"
    assert "2025-11-25" in error["data"]["supported"] and "2026-07-28" not in error["data"]["supported"]


async def test_no_event_stream_is_offered(client: httpx.AsyncClient) -> None:
    headers = {**RAW_HEADERS, "Accept": "text/event-stream"}
    r = await client.get("/mcp", headers=headers)
    assert r.status_code == 405 and r.headers["Allow"] == "POST, DELETE"


async def test_host_and_origin_are_checked(client: httpx.AsyncClient) -> None:
    body = tools_call("read_counter", {})
    r = await client.post("/mcp", json=body, headers={**RAW_HEADERS, "Host": "evil.example"})
    assert r.status_code == 421
    r = await client.post("/mcp", json=body, headers={**RAW_HEADERS, "Origin": "http://evil.example"})
    assert r.status_code == 403
    r = await client.post("/mcp", json=body, headers={**RAW_HEADERS, "Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.json()["result"]["isError"] is False


async def test_the_public_base_url_is_an_allowed_host(app_factory: AppFactory) -> None:
    async with app_factory(public_base_url="https://sparring.example.com") as client:
        headers = {**RAW_HEADERS, "Host": "sparring.example.com", "Origin": "https://sparring.example.com"}
        r = await client.post("/mcp", json=tools_call("read_counter", {}), headers=headers)
        assert r.status_code == 200
        r = await client.post(
            "/mcp", json=tools_call("read_counter", {}), headers={**headers, "Host": "x.example"}
        )
        assert r.status_code == 421


async def test_body_over_the_limit_is_413(app_factory: AppFactory) -> None:
    async with app_factory(max_body_bytes=2048) as client:
        body = tools_call("refuse", {"reason": "x" * 4096})
        r = await client.post("/mcp", json=body, headers=RAW_HEADERS)
        assert r.status_code == 413


other_pack = Pack("other")


@other_pack.tool
def read_counter() -> str:
    """The other pack's tool of the same name as the counter pack's."""
    return "the other pack's read_counter"


async def test_a_packs_endpoint_lists_and_calls_that_packs_tools(app_factory: AppFactory) -> None:
    async with app_factory(packs=[counter_pack, faults_pack, other_pack]) as client:
        transport = in_process(client.app)  # type: ignore[attr-defined]
        async with mcp_client(URL, transport=transport) as mcp:
            everywhere = {t.name for t in (await mcp.list_tools()).tools}
        assert "increment" in everywhere and "crash" in everywhere and "read_counter" not in everywhere
        async with mcp_client("http://127.0.0.1/packs/counter/mcp", transport=transport) as mcp:
            assert {t.name for t in (await mcp.list_tools()).tools} == set(counter_pack.tools)
            assert text_of(await mcp.call_tool("read_counter", {})) == '{"value":100}'
            refused = await mcp.call_tool("crash", {})
            assert refused.is_error and text_of(refused).startswith("Error: ")
        async with mcp_client("http://127.0.0.1/packs/other/mcp", transport=transport) as mcp:
            assert [t.name for t in (await mcp.list_tools()).tools] == ["read_counter"]
            assert text_of(await mcp.call_tool("read_counter", {})) == "the other pack's read_counter"
        r = await client.post("/packs/nope/mcp", json=tools_call("read_counter", {}), headers=RAW_HEADERS)
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["code"] == "not_found" and "counter, faults, other" in error["message"]
