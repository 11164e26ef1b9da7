"""Tool calls whose arguments or item no serializer writes: an `Error:` answer, never a 5xx."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.calls.test_contract import logged
from tests.conftest import new_trace


def deep(levels: int) -> str:
    """JSON text of objects nested `levels` deep (deeper than Python's json module writes)."""
    return '{"a":' * levels + '"x"' + "}" * levels


@pytest.mark.parametrize("levels", [129, 254, 300, 1000])
async def test_arguments_or_item_nested_too_deeply_are_an_error_output(
    client: httpx.AsyncClient, levels: int
) -> None:
    trace = new_trace()
    bodies = [
        # arguments as an object and as a JSON string, for stateless and state-changing tools; the item
        ("refuse", f'{{"trace_id": "{trace}", "call_id": "a", "arguments": {{"reason": {deep(levels)}}}}}'),
        ("increment", f'{{"trace_id": "{trace}", "call_id": "b", "arguments": {{"by": {deep(levels)}}}}}'),
        (
            "increment",
            json.dumps({"trace_id": trace, "call_id": "c", "arguments": f'{{"by": {deep(levels)}}}'}),
        ),
        ("read_counter", f'{{"trace_id": "{trace}", "call_id": "d", "item": {deep(levels)}}}'),
    ]
    for tool, body in bodies:
        response = await client.post(f"/tools/{tool}", content=body)
        assert response.status_code == 200, (tool, response.text[:300])
        output = response.json()["output"]
        assert output.startswith("Error: ") and ("nest more than" in output or "nests more than" in output), (
            output
        )
    rows = await logged(client, trace)
    assert [(row.call_id, row.outcome, row.status_code) for row in rows] == [
        (call_id, "model_error", 200) for call_id in "abcd"
    ]
    counter = await client.post("/tools/read_counter", json={"trace_id": trace})
    assert counter.json()["output"] == '{"value":100}', "nothing ran"


async def test_arguments_as_deep_as_real_ones_are_served(client: httpx.AsyncClient) -> None:
    response = await client.post("/tools/shapes", content=f'{{"arguments": {{"query": {deep(50)}}}}}')
    assert response.status_code == 200
    assert "valid string" in response.json()["output"], "validated as usual, not refused for its depth"


def deep_list(levels: int) -> str:
    return "[" * levels + '"x"' + "]" * levels


@pytest.mark.parametrize("field", ["call_id", "trace_id", "name", "type", "id"])
async def test_an_id_or_name_nested_too_deeply_is_a_400(client: httpx.AsyncClient, field: str) -> None:
    for path in ("/tools", "/tools/read_counter"):
        body = f'{{"call_id": "c1", "trace_id": "{new_trace()}", "{field}": {deep_list(1000)}}}'
        response = await client.post(path, content=body)
        assert response.status_code == 400, (path, response.status_code, response.text[:300])
        error = response.json()["error"]
        assert error["code"] == "bad_request" and field in error["message"], error
    # Nested as deep as anything real: read as its text, as before.
    shallow = await client.post(
        "/tools/read_counter", json={"trace_id": new_trace(), field: [["x"]]} if field != "name" else {}
    )
    assert shallow.status_code == 200, shallow.text
