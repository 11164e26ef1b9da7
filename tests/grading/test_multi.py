"""multi: sub-graders combined by the formula, sub-scores kept, failures recorded or propagated."""

from __future__ import annotations

from typing import Any

import pytest

from app.grading.graders.judge import JudgeSettings
from app.grading.graders.model import GraderConfigError, GraderUnavailable
from app.grading.graders.registry import GraderContext, build_graders
from tests.grading.judge_server import JudgeServer
from tests.grading.records import call, grade_input, rollout

# The multigrader example of OpenAI's graders guide: a fuzzy name and an exact email, averaged.
GUIDE_MULTI: dict[str, Any] = {
    "type": "multi",
    "name": "example multi grader",
    "graders": {
        "name": {
            "name": "name_grader",
            "type": "text_similarity",
            "input": "{{sample.output_json.name}}",
            "reference": "{{item.name}}",
            "evaluation_metric": "fuzzy_match",
            "pass_threshold": 0.9,
        },
        "email": {
            "name": "email_grader",
            "type": "string_check",
            "input": "{{sample.output_json.email}}",
            "reference": "{{item.email}}",
            "operation": "eq",
        },
    },
    "calculate_output": "(name + email) / 2",
}


def exact(reference: str = "{{ item.answer }}") -> dict[str, Any]:
    return {
        "type": "string_check",
        "operation": "eq",
        "input": "{{ sample.output_text }}",
        "reference": reference,
    }


async def test_the_guide_example(context: GraderContext) -> None:
    grader = build_graders({"multi": GUIDE_MULTI}, source="test", context=context)["multi"]
    item = {"name": "Ada Lovelace", "email": "ada@example.com"}
    perfect = await grader.grade(grade_input(sample={"output_json": dict(item)}, item=item))
    assert perfect.score == 1.0
    assert perfect.sub_scores == {"name": 1.0, "email": 1.0}
    wrong_email = await grader.grade(
        grade_input(sample={"output_json": {"name": "Ada Lovelace", "email": "x@y.z"}}, item=item)
    )
    assert wrong_email.score == 0.5
    assert wrong_email.sub_scores == {"name": 1.0, "email": 0.0}
    assert not grader.needs_rollout


async def test_sub_grader_failures_are_kept_under_their_key(context: GraderContext) -> None:
    config = {
        "type": "multi",
        "graders": {
            "exact": exact(),
            "code": {"type": "python", "source": "def grade(sample, item):\n    raise RuntimeError('oops')"},
        },
        "calculate_output": "0.5 * exact + 0.5 * code",
    }
    grader = build_graders({"m": config}, source="test", context=context)["m"]
    result = await grader.grade(grade_input("42", {"answer": "42"}))
    assert result.score == 0.5
    assert result.sub_scores == {"exact": 1.0, "code": 0.0}
    assert len(result.errors) == 1 and result.errors[0].startswith("code: python grader: RuntimeError: oops")


async def test_a_formula_error_scores_0_and_keeps_the_sub_scores(context: GraderContext) -> None:
    config = {"type": "multi", "graders": {"a": exact(), "b": exact("other")}, "calculate_output": "a / b"}
    grader = build_graders({"m": config}, source="test", context=context)["m"]
    result = await grader.grade(grade_input("42", {"answer": "42"}))
    assert result.score == 0.0
    assert result.sub_scores == {"a": 1.0, "b": 0.0}
    assert result.errors == ["calculate_output: division by zero in 'a / b'"]


async def test_trace_graders_combine_with_openai_types(context: GraderContext) -> None:
    config = {
        "type": "multi",
        "graders": {
            "correct": exact(),
            "budget": {"type": "tool_budget", "max_calls": 1, "decay": 0.5},
            "required": {"type": "required_tools", "tools": ["search"]},
        },
        "calculate_output": "correct * budget * required",
    }
    grader = build_graders({"m": config}, source="test", context=context)["m"]
    assert grader.needs_rollout
    record = rollout([call("search", {"q": 1}, "42"), call("search", {"q": 2}, "42")])
    result = await grader.grade(grade_input("42", {"answer": "42"}, record=record))
    assert result.score == 0.5
    assert result.sub_scores == {"correct": 1.0, "budget": 0.5, "required": 1.0}
    assert [name for name, _ in result.flags] == ["over_budget"]
    assert (await grader.grade(grade_input("42", {"answer": "42"}))).score == 0.0  # no calls: required fails


async def test_an_unavailable_sub_grader_makes_the_whole_grade_unavailable(judge_server: JudgeServer) -> None:
    context = GraderContext(judge=JudgeSettings(base_url=judge_server.base_url, max_retries=0))
    try:
        config = {
            "type": "multi",
            "graders": {
                "exact": exact(),
                "judge": {
                    "type": "score_model",
                    "model": "down",
                    "input": [{"role": "user", "content": "{{ sample.output_text }}"}],
                },
            },
            "calculate_output": "exact + judge",
        }
        grader = build_graders({"m": config}, source="test", context=context)["m"]
        with pytest.raises(GraderUnavailable, match="503"):
            await grader.grade(grade_input("42", {"answer": "42"}))
    finally:
        await context.aclose()


@pytest.mark.parametrize(
    ("config", "field", "message"),
    [
        ({"graders": {"a": exact()}, "calculate_output": "a + b"}, "calculate_output", "unknown name 'b'"),
        ({"graders": {"a": exact()}, "calculate_output": "round(a)"}, "calculate_output", "unknown function"),
        ({"graders": {"a": exact()}, "calculate_output": "a.real"}, "calculate_output", "attribute access"),
        ({"graders": {"a": exact()}, "calculate_output": "a **"}, "calculate_output", r"use \^ for powers"),
        ({"graders": {"a": exact()}, "calculate_output": ""}, "calculate_output", "at least 1 character"),
        ({"graders": {}, "calculate_output": "1"}, "graders", "non-empty"),
        (
            {"graders": {"a": {**exact(), "reference": "{{ item.x"}}, "calculate_output": "a"},
            "graders.a.reference",
            "unclosed",
        ),
        (
            {"graders": {"a": {**exact(), "operation": "is"}}, "calculate_output": "a"},
            "graders.a.operation",
            "'eq'",
        ),
        (
            {"graders": {"a": {"type": "multi"}}, "calculate_output": "a"},
            "graders.a.type",
            "cannot contain another multi",
        ),
        ({"graders": {"a-b": exact()}, "calculate_output": "1"}, "graders.a-b", "identifier"),
        ({"graders": {"min": exact()}, "calculate_output": "1"}, "graders.min", "formula function"),
        (
            {"graders": {"a": {"type": "python", "source": "def grade(:"}}, "calculate_output": "a"},
            "graders.a.source",
            "syntax error",
        ),
        (
            {"graders": {"a": {"type": "state_check", "check": "nope"}}, "calculate_output": "a"},
            "graders.a.check",
            "unknown state check",
        ),
    ],
)
def test_config_errors_name_the_field(
    context: GraderContext, config: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(GraderConfigError, match=message) as caught:
        build_graders({"combined": {"type": "multi", **config}}, source="graders.yaml", context=context)
    assert caught.value.source == "graders.yaml"
    assert caught.value.grader == "combined"
    assert caught.value.field == field
