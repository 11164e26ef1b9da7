"""Rollouts as one trace: `invoke_agent` with `chat` and `execute_tool` children (eval, canary, remote),
and MCP calls under the client's traceparent; received by a real OTLP/HTTP receiver."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from app.config import Settings
from sparring.policies import ChatPolicy
from sparring.session import RunOptions, evaluate, run_canaries
from tests.conftest import AppFactory, new_trace
from tests.mcp.conftest import in_process, mcp_client
from tests.remote.model_server import ModelServer as RemoteModel
from tests.remote.model_server import Turn
from tests.remote.processor import Row, init_request, wait_terminated
from tests.runner.conftest import NO_WAIT, target, write_graders
from tests.runner.model_server import Call, ModelRequest, ModelServer, Reply
from tests.runner.test_loop import GRADERS, counter_line
from tests.telemetry.conftest import flush, traceparent
from tests.telemetry.receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.parametrize("backend", ["embedded"])


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    [span] = [span for span in spans if span.name == name]
    return span


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return sorted(
        (s for s in spans if s.parent_span_id == parent.span_id and s.trace_id == parent.trace_id),
        key=lambda s: s.start_ns,
    )


async def test_an_mcp_call_is_an_execute_tool_span_under_the_clients_traceparent(
    traced_app: AppFactory, receiver: OtlpReceiver
) -> None:
    header, parent_trace, parent_span = traceparent()
    trace = new_trace()
    async with traced_app() as client:
        headers = {"traceparent": header, "X-Sparring-Trace-Id": trace}
        async with mcp_client(
            "http://127.0.0.1/mcp",
            transport=in_process(client.app),  # type: ignore[attr-defined]
            headers=headers,
        ) as mcp:
            await mcp.call_tool("increment", {"by": 1})
        await flush(client)
        spans = await receiver.wait_for(lambda got: any(s.name == "execute_tool increment" for s in got))
    span = one(spans, "execute_tool increment")
    assert span.trace_id == parent_trace and span.parent_span_id == parent_span
    assert span.attributes["sparring.channel"] == "mcp"
    assert span.attributes["gen_ai.conversation.id"] == trace


@pytest.fixture(scope="module")
def remote_model() -> Iterator[RemoteModel]:
    server = RemoteModel()
    server.scripts["adder"] = [
        Turn(calls=[("increment", {"by": 2, "name": None})]),
        Turn(calls=[("increment", {"by": 3, "name": None}), ("read_counter", {"name": None})]),
        Turn(text="The counter is 105."),
    ]
    server.start()
    yield server
    server.stop()


async def test_a_remote_rollout_is_one_trace_under_the_init_requests_traceparent(
    traced_app: AppFactory, receiver: OtlpReceiver, remote_model: RemoteModel
) -> None:
    header, parent_trace, parent_span = traceparent()
    row = Row.new()
    body = init_request(
        row,
        model="adder",
        model_base_url=remote_model.base_url(),
        messages=[{"role": "user", "content": "+5"}],
    )
    async with traced_app(remote_allowed_hosts=["127.0.0.1"]) as client:
        accepted = await client.post("/remote/init", json=body, headers={"traceparent": header})
        assert accepted.status_code == 200, accepted.text
        status = await wait_terminated(client, "/remote", row.rollout_id)
        assert status["state"] == "finished", status
        await flush(client)
        spans = await receiver.wait_for(lambda got: any(s.name == "invoke_agent" for s in got))

    rollout = one(spans, "invoke_agent")
    assert rollout.trace_id == parent_trace and rollout.parent_span_id == parent_span
    assert rollout.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert rollout.attributes["gen_ai.conversation.id"] == status["trace_id"]
    assert rollout.attributes["gen_ai.request.model"] == "adder"
    assert rollout.attributes["sparring.rollout.id"] == row.rollout_id
    assert rollout.attributes["sparring.rollout.ended_by"] == "answer"
    under = children(spans, rollout)
    assert [s.name for s in under if s.name.startswith("chat")] == ["chat adder"] * 3
    tools = [s for s in under if s.name.startswith("execute_tool")]
    assert sorted(s.name for s in tools) == sorted(
        ["execute_tool increment", "execute_tool increment", "execute_tool read_counter"]
    )
    assert {s.attributes["gen_ai.conversation.id"] for s in tools} == {status["trace_id"]}
    assert {s.trace_id for s in spans} == {parent_trace}  # one rollout, one trace


@pytest.fixture
def two_turns(model_server: ModelServer) -> ModelServer:
    def script(request: ModelRequest) -> Reply:
        if not request.outputs:
            return Reply(
                calls=(Call("increment", {"by": 1, "name": None}), Call("read_counter", {"name": None}))
            )
        return Reply(text="The counter is now 101.")

    model_server.script = script
    return model_server


async def test_an_eval_rollout_is_one_trace_with_chat_tool_and_grade_spans(
    traced_app: AppFactory,
    receiver: OtlpReceiver,
    two_turns: ModelServer,
    openai_client: AsyncOpenAI,
    tmp_path: Path,
) -> None:
    from app.telemetry import command_tracing

    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    warnings: list[str] = []
    settings = Settings(otel_exporter_otlp_endpoint=receiver.url)
    async with traced_app(graders_file=graders) as client:
        with command_tracing(settings, model="scripted", warn=warnings.append) as tracing:
            options = RunOptions(run="traced-eval", retry=NO_WAIT, tracing=tracing)
            report = await evaluate(
                client,
                target("says"),
                [counter_line("101")],
                lambda: ChatPolicy(openai_client, "scripted"),
                options,
            )
        assert report["rollouts"]["graded"] == 1
        await flush(client)
        spans = await receiver.wait_for(
            lambda got: (
                any(s.name == "invoke_agent" for s in got) and any(s.name == "grade says" for s in got)
            )
        )

    assert warnings == []
    rollout = one(spans, "invoke_agent")
    assert rollout.parent_span_id == ""  # the root: one rollout, one trace
    assert rollout.attributes["sparring.run"] == "traced-eval"
    assert rollout.attributes["gen_ai.provider.name"] == "openai"
    assert rollout.attributes["sparring.grade.score"] == 1.0
    assert rollout.attributes["gen_ai.usage.input_tokens"] == 22  # two turns of 11
    under = children(spans, rollout)
    names = [s.name for s in under]
    assert names[0] == "chat scripted" and names[-1] == "grade says"
    assert sorted(names) == sorted(
        [
            "chat scripted",
            "chat scripted",
            "execute_tool increment",
            "execute_tool read_counter",
            "grade says",
        ]
    )
    chat = next(s for s in under if s.name == "chat scripted")
    assert (
        chat.attributes["gen_ai.usage.input_tokens"] == 11
        and chat.attributes["gen_ai.usage.output_tokens"] == 7
    )
    assert chat.attributes["gen_ai.request.model"] == "scripted"
    conversation = rollout.attributes["gen_ai.conversation.id"]
    assert {s.attributes["gen_ai.conversation.id"] for s in under} == {conversation}
    grade = one(spans, "grade says")
    assert (
        grade.attributes["sparring.grade.score"] == 1.0 and grade.attributes["sparring.run"] == "traced-eval"
    )


async def test_each_canary_rollout_is_an_invoke_agent_span_named_by_its_canary(
    traced_app: AppFactory, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    from app.telemetry import command_tracing

    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    settings = Settings(otel_exporter_otlp_endpoint=receiver.url)
    async with traced_app(graders_file=graders) as client:
        with command_tracing(settings, model=None, warn=lambda message: None) as tracing:
            options = RunOptions(run="traced-canary", retry=NO_WAIT, tracing=tracing)
            await run_canaries(
                client, target("says"), [counter_line("101")], options, policies=["empty", "parrot"]
            )
        spans = await receiver.wait_for(lambda got: sum(s.name == "invoke_agent" for s in got) >= 2)
    rollouts = [s for s in spans if s.name == "invoke_agent"]
    assert sorted(s.attributes["sparring.canary"] for s in rollouts) == ["empty", "parrot"]
    assert {s.attributes["sparring.run"] for s in rollouts} == {"traced-canary-empty", "traced-canary-parrot"}
    assert all("gen_ai.request.model" not in s.attributes for s in rollouts)
    assert sum(s.name == "chat" for s in spans) >= 2  # a scripted turn has no model to name
