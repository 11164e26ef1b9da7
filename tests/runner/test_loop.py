"""The rollout loop against a real app (Postgres + Redis) and a scripted model behind the `openai` SDK."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from sparring.conversation import conversation_of
from sparring.http import HttpGrader, HttpToolCaller, Retry
from sparring.loop import (
    DatasetLine,
    EpisodeLimits,
    FunctionCall,
    GradeOutcome,
    ModelFailure,
    ModelTurn,
    Step,
    ToolResult,
    Transcript,
    build_sample,
    run_rollout,
)
from sparring.policies import ChatPolicy, ResponsesPolicy, chat_messages, make_policy
from sparring.wire import JSON_DEPTH_MAX, nested_deeper_than
from tests.conftest import ADMIN_KEY, AppFactory
from tests.packs import counter_pack, faults_pack
from tests.runner.conftest import NO_WAIT, Outage, admin_get, target, write_graders
from tests.runner.model_server import Call, ModelRequest, ModelServer, Reply, Unavailable

GRADERS = """
says:
  type: string_check
  name: says
  operation: like
  input: "{{ sample.output_text }}"
  reference: "{{ item.expected }}"
"""

APIS = ["responses", "chat"]


def counter_line(expected: str = "103", **extra: Any) -> DatasetLine:
    tools = [spec.function_tool() for pack in (counter_pack, faults_pack) for spec in pack.tools.values()]
    return DatasetLine.from_json(
        {
            "messages": [
                {"role": "developer", "content": "Use the counter tools."},
                {"role": "user", "content": "Add 1 and 2 to the counter, then tell me its value."},
            ],
            "tools": tools,
            "id": "counter-1",
            "expected": expected,
            **extra,
        }
    )


def policy(api: str, openai_client: AsyncOpenAI) -> ResponsesPolicy | ChatPolicy:
    return make_policy("responses" if api == "responses" else "chat", openai_client, "scripted")


@pytest.mark.parametrize("api", APIS)
async def test_parallel_calls_of_a_turn_run_together_and_the_answer_is_graded(
    api: str, app_factory: AppFactory, tmp_path: Path, model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    def script(request: ModelRequest) -> Reply:
        if not request.outputs:
            return Reply(
                calls=(Call("increment", {"by": 1, "name": None}), Call("increment", {"by": 2, "name": None}))
            )
        values = [json.loads(output)["value"] for _, output in request.outputs]
        return Reply(text=f"The counter is now {max(values)}.")

    model_server.script = script
    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    async with app_factory(graders_file=graders) as client:
        t = target("says")
        tools = HttpToolCaller(client, t.tools, run="loop-test")
        result = await run_rollout(
            policy(api, openai_client),
            tools,
            counter_line(),
            grader=HttpGrader(client, t.grader, run="loop-test"),
        )
        logged = await admin_get(client, f"/rollouts/{result.trace_id}")

    assert result.discarded is None
    assert result.ended_by == "answer"
    assert result.final_text == "The counter is now 103."
    assert result.score == 1.0
    assert result.usage.input_tokens == 22 and result.usage.output_tokens == 14  # two turns
    # Both calls of the first turn went out at once: one parallel batch in the server's log.
    assert [c["tool"] for c in logged["timeline"]] == ["increment", "increment"]
    assert {c["batch"] for c in logged["timeline"]} == {0}
    assert logged["run"] == "loop-test" and logged["item_key"] == "id:counter-1"
    # The model's second request carried both calls and their outputs, in the turn's order.
    second = model_server.requests[1]
    assert [name for _, name, _ in second.calls] == ["increment", "increment"]
    assert [call_id for call_id, _ in second.outputs] == [call_id for call_id, _, _ in second.calls]
    assert second.tools and "increment" in second.tools
    assert second.system == "Use the counter tools."


@pytest.mark.parametrize("api", APIS)
async def test_a_model_that_numbers_the_calls_of_each_answer_anew_has_every_call_applied(
    api: str, app_factory: AppFactory, tmp_path: Path, model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    """A model server that names the first call of every answer `call_0`: the rollout's second `call_0`
    is a call of its own on the server (not a retry of the first: refused, or replayed unapplied), and
    the model reads its results under the ids it wrote."""

    def script(request: ModelRequest) -> Reply:
        if len(request.outputs) < 2:
            return Reply(calls=(Call("increment", {"by": len(request.outputs) + 1, "name": None}),))
        values = [json.loads(output)["value"] for _, output in request.outputs]
        return Reply(text=f"The counter is now {max(values)}.")

    model_server.script = script
    model_server.ids_per_answer = True
    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    async with app_factory(graders_file=graders) as client:
        t = target("says")
        result = await run_rollout(
            policy(api, openai_client),
            HttpToolCaller(client, t.tools, run="loop-test"),
            counter_line(),
            grader=HttpGrader(client, t.grader, run="loop-test"),
        )
        logged = await admin_get(client, f"/rollouts/{result.trace_id}")

    assert result.final_text == "The counter is now 103." and result.score == 1.0, result
    assert [c["outcome"] for c in logged["timeline"]] == ["ok", "ok"]
    last = model_server.requests[-1]
    assert [call_id for call_id, _, _ in last.calls] == ["call_0", "call_0"]
    assert [call_id for call_id, _ in last.outputs] == ["call_0", "call_0"]
    # The stored conversation names each call as the log does, so the review pairs them.
    kept = conversation_of(result)["messages"]
    asked = [c["call_id"] for m in kept if m["role"] == "assistant" for c in m["tool_calls"]]
    answered = [(m["call_id"], json.loads(m["content"])["value"]) for m in kept if m["role"] == "tool"]
    assert asked == [c["call_id"] for c in logged["timeline"]] == ["call_0", "call_0~1"]
    assert answered == [("call_0", 101), ("call_0~1", 103)]


def test_calls_of_one_answer_sharing_an_id_each_read_their_own_output() -> None:
    """A model server that gives every call of an answer one id: the chat conversation answers each
    call with its own result, in the turn's order (a map by id gave both the last one's)."""
    calls = (FunctionCall("call", "increment", '{"by": 1}'), FunctionCall("call", "increment", '{"by": 2}'))
    step = Step(
        turn=ModelTurn(calls=calls),
        results=[ToolResult(call=calls[0], output="101"), ToolResult(call=calls[1], output="103")],
        sent=["call", "call~1"],
    )
    transcript = Transcript("trace_dup", [{"role": "user", "content": "go"}], [], {}, steps=[step])
    tool_messages = [m for m in chat_messages(transcript) if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_messages] == [("call", "101"), ("call", "103")]


@pytest.mark.parametrize("failures", [3, 1])
async def test_a_5xx_is_retried_with_the_same_call_id_and_discards_after_three(
    failures: int,
    app_factory: AppFactory,
    tmp_path: Path,
    model_server: ModelServer,
    openai_client: AsyncOpenAI,
) -> None:
    model_server.script = lambda request: (
        Reply(calls=(Call("increment", {"by": 5, "name": None}),))
        if not request.outputs
        else Reply(text="105")
    )
    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    async with app_factory(graders_file=graders) as app_client:
        outage = Outage(app_client._transport, failures)
        async with httpx.AsyncClient(transport=outage, base_url="http://sparring") as client:
            t = target("says")
            result = await run_rollout(
                policy("responses", openai_client),
                HttpToolCaller(client, t.tools, retry=NO_WAIT),
                counter_line("105"),
                grader=HttpGrader(client, t.grader),
            )
        seen = await app_client.get(
            f"/review/api/rollouts/{result.trace_id}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )

    (call_key,) = outage.attempts  # every attempt carried the same trace_id and call_id
    if failures == 3:
        assert outage.attempts[call_key] == 3
        assert result.discarded is not None and result.discarded.startswith(
            "tool_failed: increment: HTTP 503"
        )
        assert result.grade is None and result.score is None
        (failed,) = result.tool_results
        assert failed.failure_kind == "infra_error" and failed.status == 503 and failed.attempts == 3
        assert len(model_server.requests) == 1  # the model never saw the failure
        assert seen.status_code == 404  # nothing reached the server, nothing was graded
    else:
        assert outage.attempts[call_key] == 2
        assert result.discarded is None and result.score == 1.0
        assert [c["tool"] for c in seen.json()["timeline"]] == ["increment"]  # run once


async def test_mistakes_401_and_413_are_shown_to_the_model(
    app_factory: AppFactory, tmp_path: Path, model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    def script(request: ModelRequest) -> Reply:
        if not request.outputs:
            return Reply(
                calls=(
                    Call("no_such_tool", {}),
                    Call("refuse", {"reason": "not today"}),
                    Call("refuse", {"reason": "x" * (1024 * 1024 + 10)}),
                )
            )
        if len(request.outputs) == 3:  # a last, small batch: the grader's sample carries the last batch only
            return Reply(calls=(Call("read_counter", {"name": None}),))
        return Reply(text="done")

    model_server.script = script
    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    async with app_factory(graders_file=graders) as client:
        t = target("says")
        result = await run_rollout(
            policy("chat", openai_client),
            HttpToolCaller(client, t.tools),
            counter_line(),
            grader=HttpGrader(client, t.grader),
        )
        bad_key = target("says", tools_key="wrong-key")
        refused = await run_rollout(
            policy("chat", openai_client),
            HttpToolCaller(client, bad_key.tools),
            counter_line(),
            grader=HttpGrader(client, t.grader),
        )

    assert result.discarded is None and result.score == 0.0
    unknown, refusal, too_big, _ = result.tool_results
    assert unknown.status == 200 and unknown.output is not None and unknown.output.startswith("Error:")
    assert refusal.status == 200 and refusal.output == "Error: not today"
    assert too_big.status == 413 and too_big.output
    assert result.tool_errors == 3
    outputs = dict(model_server.requests[1].outputs)
    assert outputs[too_big.call.call_id] == too_big.output  # the model read the 413's body
    # A refused key is the platform's 4xx: shown to the model, not a discard.
    assert refused.discarded is None
    assert [r.status for r in refused.tool_results] == [401, 401, 413, 401]  # the size is checked first
    assert all(r.output and "error" in r.output for r in refused.tool_results)


async def test_limits_end_a_rollout_and_it_is_still_graded(
    app_factory: AppFactory, tmp_path: Path, model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    # Two parallel reads per turn, forever: the call budget cuts the second turn in half.
    model_server.script = lambda request: Reply(
        text="still looking",
        calls=(Call("read_counter", {"name": None}), Call("read_counter", {"name": None})),
    )
    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    async with app_factory(graders_file=graders) as client:
        t = target("says")
        tools, grader = HttpToolCaller(client, t.tools), HttpGrader(client, t.grader)
        by_calls = await run_rollout(
            policy("responses", openai_client),
            tools,
            counter_line("looking"),
            grader=grader,
            limits=EpisodeLimits(max_turns=10, max_tool_calls=3),
        )
        by_turns = await run_rollout(
            policy("responses", openai_client),
            tools,
            counter_line("nothing"),
            grader=grader,
            limits=EpisodeLimits(max_turns=2, max_tool_calls=50),
        )
        logged = await admin_get(client, f"/rollouts/{by_calls.trace_id}")

    assert by_calls.ended_by == "max_tool_calls"
    assert len(by_calls.tool_results) == 3 and logged["call_count"] == 3
    assert by_calls.score == 1.0  # graded on its last text, "still looking"
    assert by_calls.sample is not None
    # The final turn asked for two calls; the budget let one through, and the grader sees that one.
    assert [c["function"]["name"] for c in by_calls.sample["choices"][0]["message"]["tool_calls"]] == [
        "read_counter"
    ]
    assert by_turns.ended_by == "max_turns" and len(by_turns.transcript.steps) == 2
    assert len(by_turns.tool_results) == 4 and by_turns.score == 0.0


@pytest.mark.parametrize("number", ["NaN", "Infinity", "1e400", "1" + "0" * 400])
async def test_an_answer_with_a_number_json_has_not_is_graded_as_its_text(
    app_factory: AppFactory, tmp_path: Path, number: str
) -> None:
    """Python's json reads NaN, Infinity and numbers past the largest double; the grade route's reader
    does not, and refused the whole grade (400): the model's answer discarded its rollout."""
    answer = f'{{"total": {number}, "note": "103"}}'

    class Answers:
        async def next_turn(self, transcript: Transcript) -> ModelTurn:
            return ModelTurn(text=answer)

    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    async with app_factory(graders_file=graders) as client:
        t = target("says")
        result = await run_rollout(
            Answers(), HttpToolCaller(client, t.tools), counter_line(), grader=HttpGrader(client, t.grader)
        )
    assert result.discarded is None, result.discarded
    assert result.score == 1.0  # the text holds 103
    assert result.sample is not None and result.sample["output_json"] is None


async def test_a_model_that_stays_down_discards_the_rollout(
    app_factory: AppFactory, model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    def down(request: ModelRequest) -> Reply:
        raise Unavailable

    model_server.script = down
    async with app_factory() as client:
        t = target("says")
        result = await run_rollout(
            policy("chat", openai_client), HttpToolCaller(client, t.tools), counter_line()
        )
    assert result.ended_by == "discarded"
    assert result.discarded is not None and result.discarded.startswith("model_error:")


async def test_a_grader_that_keeps_failing_discards_the_rollout(
    app_factory: AppFactory, model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    model_server.script = lambda request: Reply(text="hello")
    async with app_factory() as client:  # no graders configured: /grade/says is a 404
        t = target("says")
        grader = HttpGrader(client, t.grader, retry=Retry(attempts=2, delay_s=0.0))
        result = await run_rollout(
            policy("chat", openai_client), HttpToolCaller(client, t.tools), counter_line(), grader=grader
        )
    # A 4xx is the operator's to fix (here an unknown grader): refused at once, not tried again.
    assert result.grade is not None and result.grade.attempts == 1 and result.grade.status == 404
    assert result.grade.failure_kind == "refused"
    assert result.discarded is not None and result.discarded.startswith("grader_failed: HTTP 404")


def test_the_sample_has_the_platform_shape() -> None:
    sample = build_sample('{"total": 3}', [])
    assert sample["output_text"] == '{"total": 3}'
    assert sample["output_json"] == {"total": 3}
    assert sample["output_tools"] == []
    assert sample["choices"][0]["message"] == {
        "role": "assistant",
        "content": '{"total": 3}',
        "tool_calls": [],
    }
    assert sample["choices"][0]["finish_reason"] == "stop"
    assert build_sample("{not json", [])["output_json"] is None


@pytest.mark.parametrize("depth", [100_000, JSON_DEPTH_MAX + 1])
async def test_an_answer_nested_too_deep_is_graded_as_its_text(depth: int) -> None:
    """A model stuck repeating `[` (100,000 levels: parsing them recursed past Python's limit), or
    nesting past what the grade routes take (they would refuse the grade): no `output_json`, graded."""
    answer = "[" * depth + "]" * depth

    class Nested:
        async def next_turn(self, transcript: Transcript) -> ModelTurn:
            return ModelTurn(text=answer)

    class NoTools:
        async def call(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("no call expected")

    samples: list[Any] = []

    class Grader:
        async def grade(self, sample: Any, item: Any, trace_id: str) -> GradeOutcome:
            samples.append(sample)
            return GradeOutcome(score=0.0)

    result = await run_rollout(Nested(), NoTools(), counter_line(), grader=Grader())
    assert result.discarded is None and result.score == 0.0
    [sample] = samples
    assert sample["output_text"] == answer and sample["output_json"] is None
    assert not nested_deeper_than(sample)


async def test_a_rollout_has_a_platform_trace_id_and_a_failing_model_sends_no_call() -> None:
    class Broken:
        async def next_turn(self, transcript: Transcript) -> Any:
            raise ModelFailure("endpoint down")

    class NoTools:
        async def call(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("no call expected")

    result = await run_rollout(Broken(), NoTools(), counter_line())
    assert result.discarded == "model_error: endpoint down"
    assert result.trace_id.startswith("trace_") and len(result.trace_id) == len("trace_") + 32
