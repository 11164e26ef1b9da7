"""string_check: the four operations of the hosted grader, on rendered templates."""

from __future__ import annotations

from typing import Any

import pytest

from app.grading.graders.registry import GraderContext, build_graders
from tests.grading.records import grade_input


def check(
    operation: str, input: str = "{{ sample.output_text }}", reference: str = "{{ item.ref }}"
) -> dict[str, Any]:
    return {
        "type": "string_check",
        "name": "check",
        "operation": operation,
        "input": input,
        "reference": reference,
    }


@pytest.mark.parametrize(
    ("operation", "answer", "reference", "expected"),
    [
        # eq: exact, case-sensitive, no trimming
        ("eq", "Correct", "Correct", 1.0),
        ("eq", "Correct", "correct", 0.0),
        ("eq", " Correct", "Correct", 0.0),
        ("eq", "", "", 1.0),
        ("eq", "", "Correct", 0.0),
        # ne: the opposite
        ("ne", "Paris", "London", 1.0),
        ("ne", "Paris", "Paris", 0.0),
        ("ne", "paris", "Paris", 1.0),
        # like: the input contains the reference, case-sensitive
        ("like", "The capital is Paris.", "Paris", 1.0),
        ("like", "The capital is paris.", "Paris", 0.0),
        ("like", "Par", "Paris", 0.0),
        ("like", "anything", "", 1.0),
        # ilike: contains, ignoring case (Unicode case folding)
        ("ilike", "THE CAPITAL IS PARIS", "paris", 1.0),
        ("ilike", "Die Straße", "STRASSE", 1.0),
        ("ilike", "London", "paris", 0.0),
    ],
)
async def test_operations(
    context: GraderContext, operation: str, answer: str, reference: str, expected: float
) -> None:
    grader = build_graders({"check": check(operation)}, source="test", context=context)["check"]
    result = await grader.grade(grade_input(answer, {"ref": reference}))
    assert result.score == expected
    assert result.errors == []
    assert not grader.needs_rollout


async def test_json_fields_and_tool_calls(context: GraderContext) -> None:
    graders = build_graders(
        {
            # the shape of openai-java issue #647's example
            "compliant": check("eq", "{{sample.output_json.compliant}}", "{{item.compliant}}"),
            "first_tool": check("eq", "{{ sample.output_tools[0].function.name }}", "search_catalog"),
        },
        source="test",
        context=context,
    )
    sample = {
        "output_json": {"compliant": "yes"},
        "output_tools": [{"id": "0", "function": {"name": "search_catalog", "arguments": "{}"}}],
    }
    inp = grade_input(sample=sample, item={"compliant": "yes"})
    assert (await graders["compliant"].grade(inp)).score == 1.0
    assert (await graders["first_tool"].grade(inp)).score == 1.0
    nothing = grade_input(sample={}, item={})
    assert (await graders["first_tool"].grade(nothing)).score == 0.0


async def test_a_template_reading_the_rollout_needs_it(context: GraderContext) -> None:
    grader = build_graders(
        {"no_calls": check("eq", "{{ rollout.tool_calls }}", "0")}, source="test", context=context
    )["no_calls"]
    assert grader.needs_rollout
    assert (await grader.grade(grade_input("x"))).score == 1.0
