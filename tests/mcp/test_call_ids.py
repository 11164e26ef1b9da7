"""MCP call ids: one per (session, JSON-RPC id), so no two requests ever share an answer by accident."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from app.mcp.server import mcp_call_id
from tests.conftest import TOOLS_KEY, new_trace
from tests.mcp.conftest import rollout

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
