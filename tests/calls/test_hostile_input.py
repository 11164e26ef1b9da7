"""Tool calls whose arguments or item no serializer writes: an `Error:` answer, never a 5xx."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import httpx
import pytest

from app.calls.envelope import ToolCallEnvelope
from app.calls.service import MODEL_ERROR_BYTES
from app.deps import app_state
from app.sdk import Pack, ToolContext
from tests.calls.test_contract import logged
from tests.conftest import AppFactory, call_body, new_trace


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


big_pack = Pack("bigstore")


@big_pack.tool(mutates=True)
def set_bags(ctx: ToolContext, total_baggages: int) -> str:
    """Stores the int the model chose and answers text (as airline's update_reservation_baggages)."""
    ctx.state.put("reservations", "R1", {"total_baggages": total_baggages})
    return f"updated to {total_baggages}"


@dataclass
class Box:
    n: int
    inner: list[dict[str, int]]
    weight: float = 0.0


@big_pack.tool(mutates=True)
def store_box(ctx: ToolContext, box: Box) -> str:
    """Stores a dataclass the model filled in."""
    ctx.state.put("boxes", "b", {"n": box.n, "inner": box.inner})
    return "stored"


@big_pack.tool(mutates=True)
def set_price(ctx: ToolContext, price: float, box: Box | None = None) -> str:
    """Stores the number the model chose (a price, a balance)."""
    ctx.state.put("prices", "p", {"price": price})
    return "stored"


@big_pack.tool
def under(price: float, limit: float = math.inf) -> str:
    """Whether the price is under the limit (none by default)."""
    return "yes" if price < limit else "no"


@big_pack.tool
def read_price(ctx: ToolContext) -> str:
    """The stored price, as the next call of the rollout reads it."""
    return repr(ctx.state.get("prices", "p"))


@big_pack.tool
def power(base: int, exponent: int) -> dict[str, int]:
    """Answers an int the tool computed, which may be wider than 64 bits."""
    return {"value": base ** min(exponent, 200)}


async def test_an_integer_beyond_64_bits_is_an_error_output_on_every_backend(app_factory: AppFactory) -> None:
    """Lax validation reads a string of 30 digits as an int no JSON store writes (orjson, Redis, bigint):
    the model is told, the same on both backends, instead of a 500 after the tool ran."""
    async with app_factory(packs=[big_pack]) as client:
        trace = new_trace()
        answers = []
        for tool, arguments in (
            ("set_bags", {"total_baggages": "1" + "0" * 25}),
            ("set_bags", {"total_baggages": str(-(2**63) - 1)}),
            ("power", {"base": "9" * 30, "exponent": 1}),
            ("store_box", {"box": {"n": "1" + "0" * 25, "inner": []}}),
            ("store_box", {"box": {"n": 1, "inner": [{"k": "1" + "0" * 25}]}}),
        ):
            body = call_body(arguments, trace_id=trace, call_id=f"c-{len(answers)}")
            first = await client.post(f"/tools/{tool}", json=body)
            again = await client.post(f"/tools/{tool}", json=body)
            answers.append((first, again))
        kept = await client.post(
            "/tools/set_bags", json=call_body({"total_baggages": 2**63 - 1}, trace_id=trace)
        )
        computed = await client.post(
            "/tools/power", json=call_body({"base": 2, "exponent": 100}, trace_id=trace)
        )
    for first, again in answers:
        assert first.status_code == 200 and again.json() == first.json(), first.text[:300]
        assert first.json()["output"].startswith("Error: invalid arguments") and "64 bits" in first.text
    assert kept.status_code == 200 and kept.json()["output"] == f"updated to {2**63 - 1}"
    # A wide int the tool computed itself is written as JSON too.
    assert computed.status_code == 200 and json.loads(computed.json()["output"]) == {"value": 2**100}


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-inf", "1e400"])
async def test_a_number_that_is_not_finite_is_an_error_output_on_every_backend(
    app_factory: AppFactory, number: str
) -> None:
    """Lax validation reads "NaN", "Infinity" or "1e400" sent as text as a float no JSON store writes
    (memory kept nan, Redis stored null): the model is told, and the state keeps its last price."""
    async with app_factory(packs=[big_pack]) as client:
        trace = new_trace()
        await client.post("/tools/set_price", json=call_body({"price": 2.5}, trace_id=trace))
        top = await client.post("/tools/set_price", json=call_body({"price": number}, trace_id=trace))
        nested = await client.post(
            "/tools/set_price",
            json=call_body({"price": 1.0, "box": {"n": 1, "inner": [], "weight": number}}, trace_id=trace),
        )
        read = await client.post("/tools/read_price", json=call_body({}, trace_id=trace))
        unlimited = await client.post(
            "/tools/under", json=call_body({"price": 3, "limit": None}, trace_id=trace)
        )
    assert top.status_code == 200 and top.json()["output"].startswith("Error: invalid arguments")
    assert "not a finite number" in top.json()["output"]
    assert nested.status_code == 200 and "not a finite number" in nested.json()["output"]
    assert read.json()["output"] == "{'price': 2.5}"
    assert unlimited.json()["output"] == "yes"  # the tool's own default is not the model's mistake


@pytest.mark.parametrize("where", ["an argument", "the tool's name"])
async def test_an_error_output_echoing_the_request_stays_small(client: httpx.AsyncClient, where: str) -> None:
    """repr() of control characters is 4 bytes each: an echoed request of ~1 MB made an output of ~4 MB."""
    trace = new_trace()
    filler = "\x7f" * 999_000
    if where == "an argument":
        path, body = "/tools/increment", {"trace_id": trace, "call_id": "c", "arguments": {"by": filler}}
    else:
        path, body = "/tools", {"trace_id": trace, "call_id": "c", "name": filler, "arguments": "{}"}
    response = await client.post(path, json=body)
    rows = await logged(client, trace)
    output = response.json()["output"]
    assert response.status_code == 200 and output.startswith("Error: ")
    assert len(output.encode()) <= MODEL_ERROR_BYTES and "[output truncated" in output
    assert [len(row.output.encode()) <= MODEL_ERROR_BYTES for row in rows] == [True]


async def test_arguments_no_json_writer_takes_never_hold_a_rollouts_lock(app_factory: AppFactory) -> None:
    """In process (a simulator, a runner), arguments are a Python mapping and may hold an int no JSON
    writer takes: refused before the rollout is claimed or locked, so its next call runs."""
    async with app_factory(tool_timeout_seconds=3) as client:
        service = app_state(client.app).call_service  # type: ignore[attr-defined]
        trace = new_trace()
        envelope = ToolCallEnvelope(name="increment", arguments={"by": 2**70}, trace_id=trace, call_id="wide")
        refused = await service.call(envelope, path_name="increment", run=None)
        after = await client.post(
            "/tools/increment", json=call_body({"by": 1}, trace_id=trace, call_id="next")
        )
    assert refused.output.output.startswith("Error: invalid arguments")
    assert after.status_code == 200, after.text[:300]
