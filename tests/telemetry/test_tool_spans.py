"""Tool calls and grades as OpenTelemetry GenAI spans, received by a real OTLP/HTTP receiver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config import Settings
from app.deps import app_state
from sparring.tracing import SCHEMA_URL
from tests.conftest import GRADER_KEY, TOOLS_KEY, AppFactory, call_body, new_trace
from tests.telemetry.conftest import flush, traceparent
from tests.telemetry.receiver import OtlpReceiver, ReceivedSpan

ERROR = 2  # the protobuf's STATUS_CODE_ERROR
INTERNAL = 1  # SPAN_KIND_INTERNAL


def named(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [span for span in spans if span.name == name]


async def test_a_tool_call_is_an_execute_tool_span_under_the_callers_traceparent(
    traced_app: AppFactory, receiver: OtlpReceiver
) -> None:
    header, parent_trace, parent_span = traceparent()
    trace = new_trace()
    async with traced_app() as client:
        # A health check with a traceparent makes no span.
        assert (await client.get("/healthz", headers={"traceparent": header})).status_code == 200
        answer = await client.post(
            "/tools/increment",
            json=call_body({"by": 2}, trace_id=trace, call_id="call_1"),
            headers={"traceparent": header, "X-Sparring-Run": "run-7"},
        )
        assert answer.status_code == 200, answer.text
        await flush(client)
        spans = await receiver.wait_for(lambda got: bool(named(got, "execute_tool increment")))

    assert [span.name for span in spans] == ["execute_tool increment"]
    [span] = spans
    assert span.trace_id == parent_trace and span.parent_span_id == parent_span
    assert span.kind == INTERNAL and span.status_code != ERROR
    assert span.attributes == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "increment",
        "gen_ai.tool.type": "function",
        "gen_ai.tool.call.id": "call_1",
        "gen_ai.conversation.id": trace,
        "sparring.run": "run-7",
        "sparring.outcome": "ok",
        "sparring.channel": "rft",
    }  # no arguments nor result: they are opt-in
    assert span.resource["service.name"] == "sparring"
    assert span.scope_schema_url == SCHEMA_URL
    assert span.start_ns < span.end_ns


async def test_every_outcome_but_ok_sets_error_type(traced_app: AppFactory, receiver: OtlpReceiver) -> None:
    trace = new_trace()
    async with traced_app() as client:
        mistake = await client.post(
            "/tools/increment", json=call_body({"by": "many"}, trace_id=trace, call_id="c1")
        )
        assert mistake.status_code == 200 and mistake.json()["output"].startswith("Error:")
        unknown = await client.post("/tools", json=call_body({}, trace_id=trace, call_id="c2", name="nope"))
        assert unknown.status_code == 200
        crash = await client.post("/tools/crash", json=call_body({}, trace_id=trace, call_id="c3"))
        assert crash.status_code == 500
        for _ in range(2):  # the retry is answered from the ledger: replayed, and ok
            ok = await client.post("/tools/increment", json=call_body({}, trace_id=trace, call_id="c4"))
            assert ok.status_code == 200
        await flush(client)
        spans = await receiver.wait_for(lambda got: len(got) >= 5)

    by_call = {}
    for span in spans:
        by_call.setdefault(span.attributes["gen_ai.tool.call.id"], []).append(span)
    [mistake_span] = by_call["c1"]
    assert mistake_span.attributes["sparring.outcome"] == "model_error"
    assert mistake_span.attributes["error.type"] == "model_error" and mistake_span.status_code == ERROR
    [unknown_span] = by_call["c2"]
    assert unknown_span.name == "execute_tool nope"
    assert unknown_span.attributes["error.type"] == "model_error"
    [crash_span] = by_call["c3"]
    assert crash_span.attributes["sparring.outcome"] == "tool_crash"
    assert crash_span.attributes["error.type"] == "tool_crash"
    first, retry = by_call["c4"]
    assert first.attributes["sparring.outcome"] == "ok" and "error.type" not in first.attributes
    assert retry.attributes["sparring.outcome"] == "replayed" and "error.type" not in retry.attributes
    assert {span.attributes["gen_ai.conversation.id"] for span in spans} == {trace}
    # Without a traceparent each call is a trace of its own.
    assert all(span.parent_span_id == "" for span in spans)


@pytest.mark.parametrize("backend", ["embedded"])
async def test_arguments_and_results_are_on_the_span_only_when_opted_in_and_cut(
    traced_app: AppFactory, receiver: OtlpReceiver
) -> None:
    trace = new_trace()
    async with traced_app(trace_content=True, trace_content_max_chars=16) as client:
        answer = await client.post(
            "/tools/big_output", json=call_body({"size": 40}, trace_id=trace, call_id="c1")
        )
        assert answer.status_code == 200
        output = answer.json()["output"]
        await flush(client)
        [span] = await receiver.wait_for(lambda got: len(got) >= 1)
    assert span.attributes["gen_ai.tool.call.arguments"] == '{"size":40}'
    result = span.attributes["gen_ai.tool.call.result"]
    assert result.startswith(output[:16]) and result != output and "characters cut" in result


GRADERS: dict[str, Any] = {
    "frugal": {
        "type": "multi",
        "name": "frugal",
        "graders": {
            "exact": {
                "type": "string_check",
                "name": "exact",
                "operation": "eq",
                "input": "{{ sample.output_text }}",
                "reference": "{{ item.reference_answer }}",
            },
            "budget": {"type": "tool_budget", "name": "budget", "max_calls": 1},
        },
        "calculate_output": "exact * budget",
    }
}


async def test_a_grade_is_a_grade_span_with_its_score_sub_scores_and_flags(
    traced_app: AppFactory, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    graders = tmp_path / "graders.yaml"
    graders.write_text(yaml.safe_dump(GRADERS))
    header, parent_trace, parent_span = traceparent()
    trace = new_trace()
    tools = {"Authorization": f"Bearer {TOOLS_KEY}"}
    async with traced_app(key=GRADER_KEY, graders_file=graders) as client:
        for n in range(3):  # over the budget of one call
            called = await client.post(
                "/tools/increment", json=call_body({}, trace_id=trace, call_id=f"c{n}"), headers=tools
            )
            assert called.status_code == 200
        sample = {"output_text": "42", "choices": [], "output_tools": []}
        graded = await client.post(
            "/grade/frugal",
            json={"sample": sample, "item": {"reference_answer": "42"}, "trace_id": trace},
            headers={"traceparent": header},
        )
        assert graded.status_code == 200, graded.text
        score = graded.json()["score"]
        other = new_trace()
        misfit = await client.post(  # the item lacks the field the grader reads: 422, a failed grade
            "/grade/frugal", json={"sample": sample, "item": {}, "trace_id": other}
        )
        assert misfit.status_code == 422, misfit.text
        missing = await client.post(
            "/grade/nobody", json={"trace_id": trace}, headers={"traceparent": header}
        )
        assert missing.status_code == 404
        await flush(client)
        spans = await receiver.wait_for(lambda got: len(named(got, "grade frugal")) >= 2)

    [grade] = [s for s in named(spans, "grade frugal") if s.attributes["gen_ai.conversation.id"] == trace]
    [failed] = [s for s in named(spans, "grade frugal") if s.attributes["gen_ai.conversation.id"] == other]
    assert failed.attributes["error.type"] == "grader_config_error" and failed.status_code == ERROR
    assert "sparring.grade.score" not in failed.attributes
    assert grade.trace_id == parent_trace and grade.parent_span_id == parent_span
    assert grade.attributes["gen_ai.operation.name"] == "grade"
    assert grade.attributes["gen_ai.conversation.id"] == trace
    assert grade.attributes["sparring.grade.score"] == score < 1.0
    assert grade.attributes["sparring.grade.sub_scores.exact"] == 1.0
    assert grade.attributes["sparring.grade.sub_scores.budget"] < 1.0
    assert "over_budget" in grade.attributes["sparring.grade.flags"]
    assert "error.type" not in grade.attributes
    assert not named(spans, "grade nobody")  # an unknown grader is refused before any grade runs


@pytest.mark.parametrize("backend", ["embedded"])
async def test_tracing_is_off_without_an_endpoint_and_on_with_either_variable(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert not Settings().tracing
    async with app_factory() as client:
        state = app_state(client.app)  # type: ignore[attr-defined]
        assert state.call_service.tracing is None and state.grading.tracing is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert Settings().tracing and Settings().otel_service_name == "sparring"
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    assert Settings().tracing


@pytest.mark.parametrize("backend", ["embedded"])
async def test_the_standard_variables_name_the_service_and_add_resource_attributes(
    traced_app: AppFactory, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "env-tools")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-collector-key=secret-1")
    async with traced_app() as client:
        await client.post("/tools/read_counter", json=call_body({}, trace_id=new_trace()))
        await flush(client)
        [span] = await receiver.wait_for(lambda got: len(got) >= 1)
    assert span.resource["service.name"] == "env-tools"
    assert span.resource["deployment.environment"] == "test"
    assert any(headers.get("x-collector-key") == "secret-1" for headers in receiver.requests)
