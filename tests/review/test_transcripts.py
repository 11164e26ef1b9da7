"""A rollout's conversation: stored by PUT /rollouts/{trace_id}/transcript (or by sparring's own loop),
read back with the rollout's detail and in the export; bad input is a 4xx with the stable error body."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from app.rollouts.transcripts import TranscriptRepository
from sparring.conversation import HttpTranscripts, conversation_of, parse_conversation
from sparring.http import Endpoint
from sparring.loop import DatasetLine, FunctionCall, ModelTurn, RolloutResult, Step, ToolResult, Transcript
from sparring.wire import call_key
from tests.conftest import GRADER_KEY, TOOLS_KEY, new_trace
from tests.review.conftest import ADMIN, ReviewApp

GRADER = {"Authorization": f"Bearer {GRADER_KEY}"}

CONVERSATION: dict[str, Any] = {
    "model": "policy-7b",
    "source": "trainer",
    "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Echo hi"}]},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "The echo tool does that.",
            "tool_calls": [{"call_id": "c1", "name": "echo", "arguments": '{"text": "hi"}'}],
        },
        {"role": "tool", "call_id": "c1", "content": "hi"},
        {"role": "simulated_user", "content": "thanks"},
        {"role": "assistant", "content": "Done: hi"},
    ],
}


async def test_a_stored_conversation_comes_back_with_the_rollout_and_in_the_export(review: ReviewApp) -> None:
    trace = new_trace()
    await review.call("echo", {"text": "hi"}, trace, call_id="c1", run="conv")
    await review.grade(trace, answer="Done: hi", score=1.0, run="conv")
    stored = await review.client.put(f"/rollouts/{trace}/transcript", json=CONVERSATION, headers=GRADER)
    assert stored.status_code == 200, stored.text
    assert stored.json()["messages"] == 6

    detail = await review.api(f"/review/api/rollouts/{trace}")
    transcript = detail["transcript"]
    assert transcript["model"] == "policy-7b" and transcript["source"] == "trainer"
    roles = [m["role"] for m in transcript["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "simulated_user", "assistant"]
    assert transcript["messages"][1]["content"] == "Echo hi"
    assert transcript["messages"][2]["tool_calls"][0]["call_id"] == detail["timeline"][0]["call_id"] == "c1"

    # A second PUT replaces the first.
    shorter = {"messages": CONVERSATION["messages"][:2]}
    assert (
        await review.client.put(f"/rollouts/{trace}/transcript", json=shorter, headers=ADMIN)
    ).status_code == 200
    assert len((await review.api(f"/review/api/rollouts/{trace}"))["transcript"]["messages"]) == 2

    export = await review.client.get("/export", params={"run": "conv"}, headers=ADMIN)
    (line,) = [orjson.loads(raw) for raw in export.content.splitlines()]
    assert [m["role"] for m in line["conversation"]["messages"]] == ["system", "user"]


async def test_a_rollout_without_a_conversation_says_null(review: ReviewApp) -> None:
    trace = new_trace()
    await review.call("echo", {"text": "x"}, trace, call_id="c1", run="none")
    await review.grade(trace, answer="x", score=0.0, run="none")
    assert (await review.api(f"/review/api/rollouts/{trace}"))["transcript"] is None
    export = await review.client.get("/export", params={"run": "none"}, headers=ADMIN)
    assert orjson.loads(export.content.splitlines()[0])["conversation"] is None


async def test_bad_transcripts_are_refused_with_the_stable_error_body(review: ReviewApp) -> None:
    trace = new_trace()
    url = f"/rollouts/{trace}/transcript"
    cases = [
        (b"not json", "not valid JSON"),
        (b"[]", "JSON object"),
        (b'{"messages": []}', "non-empty"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role"),
        (b'{"messages": [{"role": "tool", "content": "x"}]}', "messages[0].call_id"),
        (b'{"messages": [{"role": "assistant", "tool_calls": [{"name": "x"}]}]}', "tool_calls[0].call_id"),
    ]
    for body, said in cases:
        response = await review.client.put(url, content=body, headers=GRADER)
        assert response.status_code == 400, body
        error = response.json()["error"]
        assert error["code"] == "bad_request" and said in error["message"], (body, error)
    tools_key = {"Authorization": f"Bearer {TOOLS_KEY}"}
    refused = await review.client.put(url, json=CONVERSATION, headers=tools_key)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    huge = {"messages": [{"role": "user", "content": "x" * (2 * 1024 * 1024)}]}
    too_large = await review.client.put(url, json=huge, headers=GRADER)
    assert too_large.status_code == 413 and "error" in too_large.json()
    assert (await review.client.get(f"/review/api/rollouts/{trace}", headers=ADMIN)).status_code == 404


def test_the_loop_s_transcript_becomes_one_conversation() -> None:
    line = DatasetLine.from_json({"messages": [{"role": "user", "content": "go"}]})
    first, second = FunctionCall("a", "echo", "{}"), FunctionCall("b", "echo", "{}")
    reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Call echo twice."}]}
    turn = ModelTurn(text="", calls=(first, second), replay=(reasoning,))
    transcript = Transcript("trace_x", line.messages, [], line.item, [Step(turn, [ToolResult(first, "out")])])
    transcript.steps.append(Step(ModelTurn(text="done")))
    result = RolloutResult("trace_x", transcript, "done", "answer")
    conversation = conversation_of(result, model="m", source="eval")
    assert conversation["messages"] == [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "Call echo twice.",
            "tool_calls": [
                {"call_id": "a", "name": "echo", "arguments": "{}"},
                {"call_id": "b", "name": "echo", "arguments": "{}"},
            ],
        },
        {"role": "tool", "call_id": "a", "content": "out"},
        # A call past the budget was never sent: the model read the limit's error.
        {"role": "tool", "call_id": "b", "content": "Error: tool call limit reached"},
        {"role": "assistant", "content": "done", "reasoning": None, "tool_calls": []},
    ]
    # What the loop builds is what the server accepts, unchanged.
    assert parse_conversation(conversation) == conversation


def test_a_call_id_or_name_past_the_limits_is_named_as_the_log_names_it() -> None:
    """A model's call id of 300 characters is logged fitted to its column (`call_key`): the conversation
    names it so (the review pairs them by id), and the server takes the conversation (it refused ids
    and names over 200 characters, so the rollout lost its whole conversation)."""
    line = DatasetLine.from_json({"messages": [{"role": "user", "content": "go"}]})
    long_id, long_name = "c" * 300, "n" * 300
    call = FunctionCall(long_id, long_name, "{}")
    step = Step(ModelTurn(calls=(call,)), [ToolResult(call, "Error: unknown tool")], sent=[long_id])
    transcript = Transcript("trace_x", line.messages, [], line.item, [step])
    conversation = conversation_of(RolloutResult("trace_x", transcript, "", "max_turns"))
    assert parse_conversation(conversation) == conversation
    [asked] = conversation["messages"][1]["tool_calls"]
    assert asked["call_id"] == call_key(long_id) == conversation["messages"][2]["call_id"]
    assert asked["name"] == long_name[:200]


def _result(trace_id: str) -> RolloutResult:
    line = DatasetLine.from_json({"messages": [{"role": "user", "content": "go"}]})
    transcript = Transcript(trace_id, line.messages, [], line.item, [Step(ModelTurn(text="done"))])
    return RolloutResult(trace_id, transcript, "done", "answer")


async def test_the_client_stores_conversations_and_stops_asking_a_server_that_refuses(
    review: ReviewApp,
) -> None:
    trace = new_trace()
    kept = HttpTranscripts(review.client, Endpoint("http://sparring", GRADER), model="m", source="eval")
    await kept.store(_result(trace))
    async with review.sessions() as session:
        row = await TranscriptRepository(session).get(trace)
    assert row is not None and row.model == "m" and [m["role"] for m in row.messages] == ["user", "assistant"]

    sent: list[str] = []

    async def count(request: httpx.Request) -> None:
        sent.append(request.method)

    tools_key = {"Authorization": f"Bearer {TOOLS_KEY}"}
    transport = httpx.ASGITransport(app=review.app)
    async with httpx.AsyncClient(transport=transport, event_hooks={"request": [count]}) as client:
        refused = HttpTranscripts(client, Endpoint("http://sparring", tools_key), source="eval")
        for _ in range(3):
            await refused.store(_result(new_trace()))  # never raises: the run goes on
    assert refused.refused and sent == ["PUT"]  # the 403 is not asked again


async def test_the_client_stores_the_conversation_of_a_trace_id_a_url_would_misread(
    review: ReviewApp,
) -> None:
    """A trainer's own trace id (a path, a query, a percent sign) names the rollout it is, and a later
    rollout's conversation is still stored (a misrouted PUT is not taken for a server without the route)."""
    kept = HttpTranscripts(review.client, Endpoint("http://sparring", GRADER), model="m", source="trainer")
    odd = [f"{new_trace()}/step?1#a", f"{new_trace()}%2F", new_trace()]
    for trace in odd:
        await kept.store(_result(trace))
    assert not kept.refused and kept.failures == 0
    async with review.sessions() as session:
        rows = [await TranscriptRepository(session).get(trace) for trace in odd]
    assert all(row is not None and row.model == "m" for row in rows)
