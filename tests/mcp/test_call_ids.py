"""MCP call ids: one per (session, JSON-RPC id), so no two requests ever share an answer by accident."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from sqlalchemy import select

from app.db.models import ToolCall
from app.deps import app_state
from app.mcp.server import mcp_call_id
from sparring.wire import CALL_ID_META
from tests.conftest import ADMIN_KEY, TOOLS_KEY, call_body, new_trace
from tests.mcp.conftest import in_process, mcp_client, rollout, text_of

URL = "http://127.0.0.1/mcp"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

HEADERS = {
    "Host": "127.0.0.1",
    "Accept": "application/json, text/event-stream",
    "Content-Type": "application/json",
    "MCP-Protocol-Version": "2025-11-25",
    "Authorization": f"Bearer {TOOLS_KEY}",
}


async def increment(client: httpx.AsyncClient, trace: str, session: str, request_id: Any, by: int) -> str:
    body = {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": "increment", "arguments": {"by": by}},
    }
    headers = {**HEADERS, "Mcp-Session-Id": session, "X-Sparring-Trace-Id": trace}
    response = await client.post("/mcp", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["id"] == request_id
    [block] = response.json()["result"]["content"]
    return str(block["text"])


@pytest.mark.parametrize(
    "first, second",
    [
        (("a_b", "x"), ("a", "b_x")),  # the separator inside a session id or a request id
        (("s", 1), ("s", "1")),  # a number and a string of the same digits are different ids
        (("s", "mcp_s_1"), ("s", 1)),
    ],
)
async def test_distinct_sessions_and_request_ids_are_distinct_calls(
    client: httpx.AsyncClient, first: tuple[str, Any], second: tuple[str, Any]
) -> None:
    trace = new_trace()
    assert orjson.loads(await increment(client, trace, *first, by=1)) == {"value": 101}
    assert orjson.loads(await increment(client, trace, *second, by=2)) == {"value": 103}, "it ran"
    # The same session and id again: the ledger's first answer, nothing runs twice.
    assert orjson.loads(await increment(client, trace, *first, by=1)) == {"value": 101}
    calls = (await rollout(client, trace))["timeline"]
    assert len({c["call_id"] for c in calls}) == 2


def test_the_mapping_is_injective_and_fits_the_column() -> None:
    pairs = [
        ("a_b", "x"),
        ("a", "b_x"),
        ("s", 1),
        ("s", "1"),
        ("s", "1 "),
        ("x" * 64, "y" * 500),
        ("x" * 64, "y" * 499),
        ("s", 2**80),
        ("s", str(2**80)),
    ]
    ids = [mcp_call_id(session, request_id) for session, request_id in pairs]
    assert len(set(ids)) == len(ids)
    assert all(len(call_id) <= 200 for call_id in ids)


async def test_a_request_id_beyond_64_bits_is_a_call_like_any_other(client: httpx.AsyncClient) -> None:
    # JSON-RPC puts no bound on a numeric id; the id of such a request is still one call of its own.
    trace = new_trace()
    wide = 2**80
    assert orjson.loads(await increment(client, trace, "s", wide, by=1)) == {"value": 101}
    assert orjson.loads(await increment(client, trace, "s", str(wide), by=2)) == {"value": 103}
    assert orjson.loads(await increment(client, trace, "s", wide, by=1)) == {"value": 101}, "replayed"
    calls = (await rollout(client, trace))["timeline"]
    assert [c["outcome"] for c in calls] == ["ok", "ok"]
    assert len({c["call_id"] for c in calls}) == 2


async def test_a_call_id_in_meta_makes_a_retry_the_same_call(client: httpx.AsyncClient) -> None:
    """A client's retry is a new request with a new JSON-RPC id: with its own id in
    `_meta["sparring/call_id"]` the retry is the first call, answered from the ledger (as a call_id
    does on the tool routes, and in the same rollout over either path), so nothing applies twice."""
    trace = new_trace()
    meta = {CALL_ID_META: "c_retry"}
    async with mcp_client(
        URL, transport=in_process(client.app), headers={"X-Sparring-Trace-Id": trace}
    ) as mcp:  # type: ignore[attr-defined]
        first = await mcp.call_tool("increment", {"by": 5}, meta=meta)
        again = await mcp.call_tool("increment", {"by": 5}, meta=meta)
        other = await mcp.call_tool("increment", {"by": 1}, meta={CALL_ID_META: "c_other"})
        plain = await mcp.call_tool("increment", {"by": 1})
    assert [text_of(r) for r in (first, again, other, plain)] == [
        '{"value":105}',
        '{"value":105}',
        '{"value":106}',
        '{"value":107}',
    ]
    over_http = await client.post(
        "/tools/increment", json=call_body({"by": 5}, trace_id=trace, call_id="c_retry")
    )
    assert over_http.json()["output"] == '{"value":105}', "the tool routes' call_id names the same call"
    calls = (await rollout(client, trace))["timeline"]
    assert [c["call_id"] for c in calls][:2] == ["c_retry", "c_other"] and len(calls) == 3
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        rows = (await session.execute(select(ToolCall.call_id, ToolCall.outcome, ToolCall.channel))).all()
    assert sorted((o, ch) for c, o, ch in rows if c == "c_retry") == [
        ("ok", "mcp"),
        ("replayed", "mcp"),
        ("replayed", "rft"),
    ]


@pytest.mark.parametrize("given", [7, "", None, ["c1"]])
async def test_a_call_id_in_meta_that_is_not_a_string_is_refused(
    client: httpx.AsyncClient, given: Any
) -> None:
    trace = new_trace()
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "increment", "arguments": {"by": 1}, "_meta": {CALL_ID_META: given}},
    }
    headers = {**HEADERS, "Mcp-Session-Id": "s", "X-Sparring-Trace-Id": trace}
    response = await client.post("/mcp", json=body, headers=headers)
    if given is None:  # an absent id: the session's JSON-RPC id keys the call
        assert response.json()["result"]["content"][0]["text"] == '{"value":101}'
        return
    error = response.json()["error"]
    assert error["code"] == -32602 and CALL_ID_META in error["message"], error
    assert error["data"] == {"code": "invalid_call_id", "retryable": False}
    r = await client.get(f"/rollouts/{trace}", headers=ADMIN)
    assert r.status_code == 404, "nothing ran"
