"""Model graders against a small OpenAI-compatible server on loopback: answers, outages, timeouts, cache."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from app.grading.graders.judge import JudgeSettings
from app.grading.graders.model import Grader, GraderUnavailable
from app.grading.graders.registry import GraderContext, build_graders
from tests.grading.judge_server import BROKEN, JudgeServer
from tests.grading.records import call, grade_input, rollout


def score_model(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": "score_model",
        "name": "judge",
        "model": model,
        "input": [
            {"role": "system", "content": "Answer with the number you are given."},
            {"role": "user", "content": "{{ sample.output_text }}"},
        ],
        **extra,
    }


def label_model(model: str = "label") -> dict[str, Any]:
    return {
        "type": "label_model",
        "name": "verdict",
        "model": model,
        "input": [
            {"role": "developer", "content": "Classify the answer."},
            {"role": "user", "content": [{"type": "input_text", "text": "{{ sample.output_text }}"}]},
        ],
        "labels": ["resolved", "partially_resolved", "unresolved"],
        "passing_labels": ["resolved"],
    }


def cosine(model: str = "letters") -> dict[str, Any]:
    return {
        "type": "text_similarity",
        "name": "semantic",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.reference_answer }}",
        "evaluation_metric": "cosine",
        "embedding_model": model,
    }


Build = Callable[[dict[str, Any]], Grader]


@pytest.fixture
def build(judge_context: GraderContext) -> Build:
    def make(config: dict[str, Any]) -> Grader:
        return build_graders({"g": config}, source="test", context=judge_context)["g"]

    return make


@asynccontextmanager
async def judge_with(**settings: Any) -> AsyncIterator[GraderContext]:
    context = GraderContext(judge=JudgeSettings(**settings))
    try:
        yield context
    finally:
        await context.aclose()


@pytest.mark.parametrize(
    ("answer", "score_range", "expected"),
    [
        ("0.3", None, 0.3),
        ("1", None, 1.0),
        ("7", None, 1.0),  # clipped to the range
        ("-2", None, 0.0),
        ("7", [0, 10], 7.0),
        ("12.5", [0, 10], 10.0),
        ("-0.5", [-1, 1], -0.5),
    ],
)
async def test_score_model_result_clipped_to_range(
    build: Build, answer: str, score_range: list[float] | None, expected: float
) -> None:
    extra = {"range": score_range} if score_range else {}
    result = await build(score_model("echo", **extra)).grade(grade_input(answer))
    assert result.score == pytest.approx(expected)
    assert result.errors == []


@pytest.mark.parametrize(
    ("model", "answer", "expected", "error"),
    [
        ("words", "0.9", 0.0, "not a number: 'high'"),
        ("echo", "very good", 0.0, "not a number: 'very good'"),
        ("prose", "0.9", 0.0, "not JSON"),
        ("empty", "0.9", 0.0, "empty answer"),
        ("echo", "", 0.0, "not a number"),
        ("fenced", "0.4", 0.4, None),
        ("bare", "0.6", 0.6, None),
        ("bare", "nan", 0.0, "not JSON"),
        ("bare", "[1, 2]", 0.0, "not a number"),
    ],
)
async def test_malformed_judge_answers_score_0_with_the_reason(
    build: Build, model: str, answer: str, expected: float, error: str | None
) -> None:
    result = await build(score_model(model)).grade(grade_input(answer))
    assert result.score == pytest.approx(expected)
    if error is None:
        assert result.errors == []
    else:
        assert len(result.errors) == 1 and error in result.errors[0]


async def test_request_carries_messages_schema_and_sampling_params(
    build: Build, judge_server: JudgeServer
) -> None:
    grader = build(
        score_model(
            "echo",
            sampling_params={"temperature": 0, "seed": 42, "max_completions_tokens": 256, "top_p": 1},
        )
    )
    await grader.grade(grade_input("0.25", {"unused": 1}))
    body = judge_server.last["chat"]
    assert body["messages"] == [
        {"role": "system", "content": "Answer with the number you are given."},
        {"role": "user", "content": "0.25"},
    ]
    assert body["temperature"] == 0 and body["seed"] == 42 and body["top_p"] == 1
    assert body["max_completion_tokens"] == 256
    schema = body["response_format"]["json_schema"]["schema"]
    assert schema["required"] == ["steps", "result"]
    assert schema["properties"]["result"] == {"type": "number"}


async def test_label_model(build: Build, judge_server: JudgeServer) -> None:
    grader = build(label_model())
    assert (await grader.grade(grade_input("resolved"))).score == 1.0
    assert (await grader.grade(grade_input("unresolved"))).score == 0.0
    unknown = await grader.grade(grade_input("maybe"))
    assert unknown.score == 0.0 and "not one of" in unknown.errors[0]
    body = judge_server.last["chat"]
    assert body["messages"][1] == {"role": "user", "content": [{"type": "text", "text": "maybe"}]}
    assert body["response_format"]["json_schema"]["schema"]["properties"]["result"]["enum"] == [
        "resolved",
        "partially_resolved",
        "unresolved",
    ]


async def test_rollout_in_the_prompt(build: Build, judge_server: JudgeServer) -> None:
    config = score_model("echo")
    config["input"][1]["content"] = "{{ rollout.tool_calls }}"
    grader = build(config)
    assert grader.needs_rollout
    record = rollout([call("search", {"q": "x"})])
    result = await grader.grade(grade_input("ignored", record=record))
    assert result.score == 1.0
    assert judge_server.last["chat"]["messages"][1]["content"] == "1"


async def test_identical_requests_are_answered_from_the_cache(
    build: Build, judge_server: JudgeServer
) -> None:
    grader = build(score_model("echo", sampling_params={"seed": 7}))
    before = judge_server.requests["echo"]
    first = await grader.grade(grade_input("0.61"))
    second = await grader.grade(grade_input("0.61"))
    assert first.score == second.score == pytest.approx(0.61)
    assert judge_server.requests["echo"] == before + 1
    await grader.grade(grade_input("0.62"))  # another rendered prompt: another request
    assert judge_server.requests["echo"] == before + 2


async def test_concurrent_identical_requests_share_one_call(build: Build, judge_server: JudgeServer) -> None:
    grader = build(score_model("echo", sampling_params={"seed": 8}))
    before = judge_server.requests["echo"]
    results = await asyncio.gather(*(grader.grade(grade_input("0.33")) for _ in range(8)))
    assert [r.score for r in results] == [pytest.approx(0.33)] * 8
    assert judge_server.requests["echo"] == before + 1


async def test_different_params_are_not_the_same_request(
    judge_context: GraderContext, judge_server: JudgeServer
) -> None:
    graders = build_graders(
        {
            "a": score_model("echo", sampling_params={"seed": 1}),
            "b": score_model("echo", sampling_params={"seed": 2}),
        },
        source="test",
        context=judge_context,
    )
    before = judge_server.requests["echo"]
    await graders["a"].grade(grade_input("0.5"))
    await graders["b"].grade(grade_input("0.5"))
    assert judge_server.requests["echo"] == before + 2


async def test_outage_after_retries_is_unavailable(judge_server: JudgeServer) -> None:
    async with judge_with(base_url=judge_server.base_url, api_key="k", timeout=5, max_retries=2) as context:
        grader = build_graders({"g": score_model("down")}, source="test", context=context)["g"]
        before = judge_server.requests["down"]
        with pytest.raises(GraderUnavailable, match="HTTP 503"):
            await grader.grade(grade_input("0.5"))
        assert judge_server.requests["down"] == before + 3  # the first try and the SDK's two retries
        # A failure is not cached: the next grade asks again.
        with pytest.raises(GraderUnavailable):
            await grader.grade(grade_input("0.5"))
        assert judge_server.requests["down"] == before + 6


async def test_refused_key_is_unavailable(build: Build) -> None:
    with pytest.raises(GraderUnavailable, match="HTTP 401"):
        await build(score_model("forbidden")).grade(grade_input("0.5"))


async def test_unreachable_judge_is_unavailable() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with judge_with(base_url=f"http://127.0.0.1:{port}/v1", timeout=2, max_retries=0) as context:
        grader = build_graders({"g": score_model("echo")}, source="test", context=context)["g"]
        with pytest.raises(GraderUnavailable, match="unreachable"):
            await grader.grade(grade_input("0.5"))


async def test_slow_judge_times_out_as_unavailable(judge_server: JudgeServer) -> None:
    async with judge_with(base_url=judge_server.base_url, timeout=0.3, max_retries=0) as context:
        grader = build_graders({"g": score_model("slow")}, source="test", context=context)["g"]
        with pytest.raises(GraderUnavailable, match="timed out"):
            await grader.grade(grade_input("0.5"))


async def test_cosine_through_embeddings(build: Build, judge_server: JudgeServer) -> None:
    grader = build(cosine())
    same = await grader.grade(grade_input("abc", {"reference_answer": "cab"}))
    assert same.score == pytest.approx(1.0)
    disjoint = await grader.grade(grade_input("aaa", {"reference_answer": "bbb"}))
    assert disjoint.score == 0.0
    partial = await grader.grade(grade_input("ab", {"reference_answer": "a"}))
    assert partial.score == pytest.approx(2**-0.5)
    assert judge_server.last["embeddings"]["model"] == "letters"


async def test_embeddings_are_cached_per_text(build: Build, judge_server: JudgeServer) -> None:
    grader = build(cosine("cache-check"))
    key = "embeddings:cache-check"
    before = judge_server.requests[key]
    await grader.grade(grade_input("first answer", {"reference_answer": "the reference"}))
    assert judge_server.requests[key] == before + 2
    await grader.grade(grade_input("second answer", {"reference_answer": "the reference"}))
    assert judge_server.requests[key] == before + 3  # the reference came from the cache
    assert (await grader.grade(grade_input("", {"reference_answer": "the reference"}))).score == 0.0
    assert judge_server.requests[key] == before + 3  # an empty answer never reaches the endpoint


@pytest.mark.parametrize("model", BROKEN)
async def test_a_200_that_is_no_whole_completion_is_unavailable_never_a_0(
    build: Build, judge_server: JudgeServer, model: str
) -> None:
    """A proxy's error page, `{"error": ...}`, `{}`, a null message, a number for content, an answer cut at
    the token limit: the judge failed (a 503 the trainer retries), never a verdict of 0, and none cached."""
    grader = build(score_model(model))
    for _ in range(2):
        with pytest.raises(GraderUnavailable, match="no usable completion"):
            await grader.grade(grade_input("0.5"))
    assert judge_server.requests[model] == 2
    if model == "cut":
        with pytest.raises(GraderUnavailable, match="max_completions_tokens"):
            await grader.grade(grade_input("0.5"))


@pytest.mark.parametrize("model", ["nodata", "nullvector"])
async def test_an_embeddings_answer_without_a_vector_is_unavailable(build: Build, model: str) -> None:
    with pytest.raises(GraderUnavailable, match="no usable completion"):
        await build(cosine(model)).grade(grade_input("abc", {"reference_answer": "abd"}))


async def test_embeddings_outage_is_unavailable(build: Build) -> None:
    with pytest.raises(GraderUnavailable, match="HTTP 503"):
        await build(cosine("down")).grade(grade_input("abc", {"reference_answer": "abc"}))


def test_model_graders_need_a_judge_endpoint() -> None:
    from app.grading.graders.model import GraderConfigError

    context = GraderContext()
    for config, field in [
        (score_model("m"), "model"),
        (label_model(), "model"),
        (cosine(), "evaluation_metric"),
    ]:
        with pytest.raises(GraderConfigError, match="SPARRING_JUDGE") as caught:
            build_graders({"g": config}, source="graders.yaml", context=context)
        assert caught.value.field == field
