"""The Agent RFT status contract: every row of the table, on both backends."""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import pytest
from sqlalchemy import select

from app.db.models import ToolCall
from app.deps import app_state
from app.sdk import Pack, ToolError, ToolUnavailable
from tests.conftest import ADMIN_KEY, API_KEYS, GRADER_KEY, AppFactory, call_body, new_trace


async def logged(client: httpx.AsyncClient, trace_id: str) -> list[ToolCall]:
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        result = await session.scalars(
            select(ToolCall).where(ToolCall.trace_id == trace_id).order_by(ToolCall.id)
        )
        return list(result.all())


async def test_result_is_200_with_string_output_and_echoed_ids(client: httpx.AsyncClient) -> None:
    trace = new_trace()
    body = call_body(json.dumps({"by": 5}), trace_id=trace, call_id="call_9", id="fc_9")
    r = await client.post("/tools/increment", json=body)
    assert r.status_code == 200
    assert r.json() == {
        "type": "function_call_output",
        "call_id": "call_9",
        "id": "fc_9",
        "output": '{"value":105}',
    }
    [row] = await logged(client, trace)
    assert (row.tool, row.outcome, row.status_code, row.output) == ("increment", "ok", 200, '{"value":105}')


async def test_a_tool_url_with_a_trailing_slash_is_the_same_tool(client: httpx.AsyncClient) -> None:
    # A server_url registered as ".../tools/increment/" is answered, not redirected (a 307 with no
    # output, which the training service need not follow and would show the model as an error).
    trace = new_trace()
    for path, by, value in (("/tools/increment/", 5, 105), ("/packs/counter/tools/increment/", 1, 106)):
        r = await client.post(path, json=call_body(json.dumps({"by": by}), trace_id=trace, call_id=path))
        assert r.status_code == 200 and r.json()["output"] == f'{{"value":{value}}}', (path, r.text)
    r = await client.post(
        "/tools/", json={**call_body("{}", trace_id=trace, call_id="c3"), "name": "read_counter"}
    )
    assert r.status_code == 200 and r.json()["output"] == '{"value":106}', r.text
    assert [row.tool for row in await logged(client, trace)] == ["increment", "increment", "read_counter"]


async def test_foundry_sample_envelope_dispatches_on_name(client: httpx.AsyncClient) -> None:
    # The shape Microsoft's samples send to one URL shared by many tools.
    body = {
        "type": "function_call",
        "id": "fc_123",
        "call_id": "call_123",
        "name": "shapes",
        "arguments": '{"query":"Urban Puffer","mode":"fast","kind":"a","tags":["x"],"address":null,"limit":3}',  # noqa: E501
        "trace_id": "trace_e7580f1e4c884b868336ed2340d4d29d",
        "item": {"reference_answer": "JKT-URB-009"},
    }
    r = await client.post("/tools", json=body)
    assert r.status_code == 200
    out = r.json()
    assert out["call_id"] == "call_123" and out["id"] == "fc_123"
    assert orjson.loads(out["output"]) == {
        "query": "Urban Puffer",
        "mode": "fast",
        "kind": "a",
        "tags": ["x"],
        "address": None,
        "limit": 3,
    }


async def test_build_hour_body_with_only_arguments(client: httpx.AsyncClient) -> None:
    r = await client.post("/tools/increment", json={"arguments": {"by": 1}})
    assert r.status_code == 200
    assert r.json()["output"] == '{"value":101}'
    assert r.json()["call_id"] is None


async def test_extra_fields_and_wrong_types_are_tolerated(client: httpx.AsyncClient) -> None:
    body = call_body({"by": 1}, trace_id=new_trace(), call_id=17, unknown={"deep": [1]}, status="completed")
    body["item"] = ["not", "an", "object"]
    r = await client.post("/tools/increment", json=body)
    assert r.status_code == 200
    assert r.json()["call_id"] == "17"


async def test_functions_prefix_on_the_name_is_accepted(client: httpx.AsyncClient) -> None:
    r = await client.post("/tools", json={"name": "functions.read_counter", "arguments": "{}"})
    assert r.json()["output"] == '{"value":100}'


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        (
            "/tools/nope",
            {"arguments": "{}"},
            "Error: unknown tool 'nope'. Available tools: big_output, crash,",
        ),
        ("/tools", {"name": "nope"}, "Error: unknown tool 'nope'."),
        ("/tools", {"arguments": "{}"}, "Error: the call does not name a tool. Available tools:"),
        (
            "/tools/increment",
            {"arguments": "{by: 1"},
            "Error: the arguments for 'increment' are not valid JSON",
        ),
        (
            "/tools/increment",
            {"arguments": "[1, 2]"},
            "Error: the arguments for 'increment' must be a JSON object",
        ),
        (
            "/tools/increment",
            {"arguments": "null"},
            "Error: the arguments for 'increment' must be a JSON object, not null",
        ),
        (
            "/tools/increment",
            {"arguments": '{"by": "lots"}'},
            "Error: invalid arguments for 'increment': by: Input should be a valid integer",
        ),
        (
            "/tools/shapes",
            {"arguments": '{"query": "q", "mode": "medium", "kind": "a", "tags": []}'},
            "Error: invalid arguments for 'shapes': mode: Input should be 'fast' or 'slow'",
        ),
        (
            "/tools/refuse",
            {"arguments": '{"reason": "order #W1 not found"}'},
            "Error: order #W1 not found",
        ),
        (
            "/tools/increment",
            {"name": "read_counter", "arguments": "{}"},
            "Error: this call names the tool 'read_counter' but was sent to the URL of the tool 'increment'",
        ),
    ],
)
async def test_model_mistakes_are_readable_outputs(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], expected: str
) -> None:
    trace = new_trace()
    r = await client.post(path, json={**body, "trace_id": trace, "call_id": "c1"})
    assert r.status_code == 200
    assert r.json()["output"].startswith(expected), r.json()["output"]
    [row] = await logged(client, trace)
    assert row.outcome == "model_error" and row.status_code == 200
    assert row.error == r.json()["output"]


async def test_schema_error_names_missing_and_extra_fields(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/tools/shapes", json={"arguments": {"mode": "fast", "kind": "a", "tags": [], "color": 1}}
    )
    output = r.json()["output"]
    assert "query: required field is missing" in output
    assert "color: unexpected field" in output


async def test_null_for_a_defaulted_parameter_means_the_default(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/tools/shapes",
        json={
            "arguments": {
                "query": "q",
                "mode": "slow",
                "kind": "b",
                "tags": [],
                "address": None,
                "limit": None,
            }
        },
    )
    assert orjson.loads(r.json()["output"])["limit"] == 5


async def test_tool_crash_is_500_and_logged(client: httpx.AsyncClient) -> None:
    trace = new_trace()
    r = await client.post("/tools/crash", json=call_body("{}", trace_id=trace, call_id="c1"))
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "tool_crashed"
    message = r.json()["error"]["message"]
    assert "RuntimeError" in message and "boom" not in message  # the exception's text stays in the logs
    [row] = await logged(client, trace)
    assert row.outcome == "tool_crash" and row.status_code == 500
    assert "RuntimeError: boom" in row.error
    # A crash is not an answer: the retry runs the tool again (and crashes again), it is not replayed.
    r2 = await client.post("/tools/crash", json=call_body("{}", trace_id=trace, call_id="c1"))
    assert r2.status_code == 500
    assert len(await logged(client, trace)) == 2


unsendable_pack = Pack("unsendable")


@unsendable_pack.tool
def lone_surrogate(as_text: bool) -> str | dict[str, str]:
    """Answer text no UTF-8 encoder writes (a lone surrogate, as `surrogateescape` decoding leaves)."""
    text = b"caf\xe9".decode("utf-8", "surrogateescape")
    return text if as_text else {"name": text}


@unsendable_pack.tool
def refuse_unsendably() -> str:
    """Refuse with a message no UTF-8 encoder writes: the `Error:` output cannot be built."""
    raise ToolError("no file named " + b"caf\xe9".decode("utf-8", "surrogateescape"))


async def test_a_call_answered_by_a_bug_s_500_is_logged(app_factory: AppFactory) -> None:
    async with app_factory(packs=[unsendable_pack]) as client:
        trace = new_trace()
        r = await client.post("/tools/refuse_unsendably", json=call_body({}, trace_id=trace, call_id="c1"))
        assert r.status_code == 500
        [row] = await logged(client, trace)
        assert (row.outcome, row.status_code, row.output) == ("infra_error", 500, None)


@unsendable_pack.tool
def unavailable_unsendably() -> str:
    """Report an outage whose message no UTF-8 encoder writes."""
    raise ToolUnavailable("no mount named " + b"caf\xe9".decode("utf-8", "surrogateescape"))


async def test_an_outage_message_no_encoder_writes_is_still_a_503(app_factory: AppFactory) -> None:
    async with app_factory(packs=[unsendable_pack]) as client:
        trace = new_trace()
        r = await client.post(
            "/tools/unavailable_unsendably", json=call_body({}, trace_id=trace, call_id="c1")
        )
        assert r.status_code == 503 and r.headers["Retry-After"]
        assert "no mount named caf" in r.json()["error"]["message"]


@pytest.mark.parametrize("as_text", [True, False], ids=["text", "object"])
async def test_an_output_that_cannot_be_sent_is_a_logged_tool_crash(
    app_factory: AppFactory, as_text: bool
) -> None:
    async with app_factory(packs=[unsendable_pack]) as client:
        trace = new_trace()
        r = await client.post(
            "/tools/lone_surrogate", json=call_body({"as_text": as_text}, trace_id=trace, call_id="c1")
        )
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "tool_crashed"
        [row] = await logged(client, trace)
        assert row.outcome == "tool_crash" and row.status_code == 500


async def test_unparseable_body_is_400_json(client: httpx.AsyncClient) -> None:
    r = await client.post(
        "/tools/increment", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "bad_request"
    r = await client.post("/tools/increment", json=[1, 2])
    assert r.status_code == 400


async def test_body_over_the_limit_is_413_by_content_length(app_factory: AppFactory) -> None:
    async with app_factory(max_body_bytes=2048) as client:
        r = await client.post("/tools/refuse", json={"arguments": {"reason": "x" * 4000}})
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "payload_too_large"
        ok = await client.post("/tools/refuse", json={"arguments": {"reason": "x" * 100}})
        assert ok.status_code == 200


async def test_body_over_the_limit_is_413_while_streaming(app_factory: AppFactory) -> None:
    async def chunks() -> Any:
        for _ in range(10):
            yield b" " * 1024  # no Content-Length: the limit is enforced on the stream

    async with app_factory(max_body_bytes=2048) as client:
        r = await client.post("/tools/refuse", content=chunks())
        assert r.status_code == 413


async def test_output_over_the_cap_is_truncated_with_a_marker(app_factory: AppFactory) -> None:
    async with app_factory(max_output_bytes=1000) as client:
        r = await client.post("/tools/big_output", json={"arguments": {"size": 5000}})
        output = r.json()["output"]
        assert r.status_code == 200
        assert len(output.encode()) <= 1000
        assert output.startswith("xxxx")
        assert "[output truncated:" in output and "of 5000 bytes cut]" in output
        small = await client.post("/tools/big_output", json={"arguments": {"size": 900}})
        assert small.json()["output"] == "x" * 900


async def test_missing_and_wrong_keys_are_401_wrong_scope_403(app_factory: AppFactory) -> None:
    async with app_factory(key=None) as client:
        r = await client.post("/tools/read_counter", json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        r = await client.post("/tools/read_counter", json={}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await client.post(
            "/tools/read_counter", json={}, headers={"Authorization": f"Bearer {GRADER_KEY}"}
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
        r = await client.post(
            "/tools/read_counter", json={}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
        assert r.status_code == 200
        r = await client.get("/rollouts", headers={"Authorization": "Bearer tools-key-123"})
        assert r.status_code == 403
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code == 200


async def test_custom_auth_header_takes_the_bare_key(app_factory: AppFactory) -> None:
    async with app_factory(key=None, auth_header="X-Functions-Key") as client:
        r = await client.post("/tools/read_counter", json={}, headers={"X-Functions-Key": "tools-key-123"})
        assert r.status_code == 200
        r = await client.post(
            "/tools/read_counter", json={}, headers={"Authorization": "Bearer tools-key-123"}
        )
        assert r.status_code == 401


async def test_list_tools_shows_schema_and_mutates(client: httpx.AsyncClient) -> None:
    r = await client.get("/tools")
    tools = {t["name"]: t for t in r.json()}
    assert tools["increment"]["mutates"] is True and tools["read_counter"]["mutates"] is False
    assert tools["increment"]["parameters"]["additionalProperties"] is False
    assert tools["increment"]["description"] == "Add `by` to a counter and return its new value."


async def test_docs_need_an_admin_key_unless_public(app_factory: AppFactory) -> None:
    async with app_factory() as client:
        assert (await client.get("/openapi.json")).status_code == 403
        r = await client.get("/openapi.json", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 200 and "/tools/{name}" in r.json()["paths"]
    async with app_factory(key=None, docs_public=True) as client:
        assert (await client.get("/openapi.json")).status_code == 200


async def test_a_tool_past_its_deadline_is_a_503_with_the_configured_retry_after(
    app_factory: AppFactory,
) -> None:
    async with app_factory(retry_after_seconds=7, tool_timeout_seconds=0.2) as client:
        r = await client.post(
            "/tools/slow", json=call_body({"seconds": 2}, trace_id=new_trace(), call_id="c1")
        )
        assert r.status_code == 503 and r.headers["Retry-After"] == "7", (r.headers, r.text)


async def test_never_429_even_when_the_log_queue_is_full(app_factory: AppFactory) -> None:
    async with app_factory(log_queue_size=1, log_batch_size=1) as client:
        import asyncio

        results = await asyncio.gather(
            *(
                client.post("/tools/read_counter", json={"trace_id": new_trace(), "call_id": "c"})
                for _ in range(60)
            )
        )
        codes = {r.status_code for r in results}
        assert codes <= {200, 503}
        assert 503 in codes, "a one-slot queue under 60 simultaneous calls must shed load"
        for r in results:
            if r.status_code == 503:
                assert r.headers["Retry-After"].isdigit()
                assert r.json()["error"]["code"] == "call_log_unavailable"


async def test_metrics_count_calls_by_outcome_and_replays(client: httpx.AsyncClient) -> None:
    trace = new_trace()
    await client.post("/tools/increment", json=call_body({"by": 1}, trace_id=trace, call_id="m1"))
    await client.post("/tools/increment", json=call_body({"by": 1}, trace_id=trace, call_id="m1"))
    await client.post("/tools/refuse", json=call_body({"reason": "no"}, trace_id=trace, call_id="m2"))
    for invented in ("made_up_1", "made_up_2"):
        await client.post(f"/tools/{invented}", json=call_body({}, trace_id=trace, call_id=invented))
    assert (await client.get("/metrics")).status_code == 403
    r = await client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    text = r.text
    assert 'sparring_tool_calls_total{outcome="ok",tool="increment"} 2.0' in text
    assert 'sparring_tool_calls_total{outcome="model_error",tool="refuse"} 1.0' in text
    assert 'sparring_tool_calls_total{outcome="model_error",tool="(unknown)"} 2.0' in text
    assert "made_up" not in text, "tool names the model invented must not become metric labels"
    assert "sparring_ledger_replays_total 1.0" in text
    assert "sparring_log_batch_size_count" in text


async def test_a_metrics_key_reads_the_metrics_and_nothing_else(app_factory: AppFactory) -> None:
    scraper = "metrics-key-for-prometheus"
    async with app_factory(key=scraper, api_keys=f"{API_KEYS},metrics:{scraper}") as client:
        r = await client.get("/metrics")
        assert r.status_code == 200 and "sparring_tool_calls_total" in r.text
        call = await client.post("/tools/increment", json=call_body({"by": 1}, trace_id=new_trace()))
        assert call.status_code == 403 and call.json()["error"]["code"] == "forbidden"
        assert (await client.get("/review/api/runs")).status_code == 403
        assert (await client.post("/grade", json={})).status_code == 403
