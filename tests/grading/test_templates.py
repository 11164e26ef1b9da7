"""Templates: the platform's syntax and rendering, our rollout namespace, and start-up errors."""

from __future__ import annotations

from typing import Any

import pytest

from app.grading.graders.templates import Scope, TemplateError, compile_template, rollout_namespace
from app.sdk import GradingConfigError
from tests.grading.records import call, rollout

SAMPLE: dict[str, Any] = {
    "output_text": "Paris",
    "output_json": {"name": "Ada", "age": 36, "tags": ["a", "b"], "ok": True, "none": None},
    "output_tools": [
        {"id": "0", "type": "function", "function": {"name": "search_catalog", "arguments": '{"q": "x"}'}}
    ],
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris"}}],
}
ITEM: dict[str, Any] = {
    "reference_answer": "Paris",
    "ground_truth": {"date": "2024-05-01", "amount": 12.5},
    "with space": {"inner key": "found"},
    "list": [10, 20, 30],
}


def render(
    text: str, sample: dict[str, Any] | None = None, item: dict[str, Any] | None = None, **kw: Any
) -> str:
    scope = Scope(sample=SAMPLE if sample is None else sample, item=ITEM if item is None else item, **kw)
    return compile_template(text).render(scope)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ item.reference_answer }}", "Paris"),
        ("{{item.reference_answer}}", "Paris"),
        ("{{   sample.output_text   }}", "Paris"),
        ("{{ sample.output_tools[0].function.name }}", "search_catalog"),
        ("{{sample.output_tools[0].function.arguments}}", '{"q": "x"}'),
        ("{{ item.ground_truth.date }}", "2024-05-01"),
        ("{{ sample.output_json.name }}", "Ada"),
        (
            "Answer: {{ sample.output_text }} / expected {{ item.reference_answer }}.",
            "Answer: Paris / expected Paris.",
        ),
        ("no template at all", "no template at all"),
        ("", ""),
        # non-string values render as compact JSON; null as nothing
        ("{{ sample.output_json.age }}", "36"),
        ("{{ item.ground_truth.amount }}", "12.5"),
        ("{{ sample.output_json.ok }}", "true"),
        ("{{ sample.output_json.tags }}", '["a","b"]'),
        ("{{ item.ground_truth }}", '{"date":"2024-05-01","amount":12.5}'),
        ("[{{ sample.output_json.none }}]", "[]"),
        # lists: [n], negative [n], .n
        ("{{ item.list[1] }}", "20"),
        ("{{ item.list[-1] }}", "30"),
        ("{{ item.list.0 }}", "10"),
        ("{{ sample.choices[-1].message.content }}", "Paris"),
        ('{{ item["with space"]["inner key"] }}', "found"),
        # a missing path renders as an empty string, like on the platform
        ("[{{ sample.output_text.length }}]", "[]"),
        ("[{{ sample.output_json.tags.x }}]", "[]"),
    ],
)
def test_rendering(template: str, expected: str) -> None:
    assert render(template) == expected


def test_an_empty_sample_renders_empty() -> None:
    assert render("<{{ sample.output_text }}|{{ item.reference_answer }}>", sample={}) == "<|Paris>"


@pytest.mark.parametrize(
    "template",
    ["[{{ item.missing }}]", "[{{ item.ground_truth.missing.deeper }}]", "[{{ item.list[7] }}]"],
)
def test_an_item_field_the_row_lacks_is_a_configuration_error(template: str) -> None:
    """The dataset row is the operator's: scoring against an empty string would be a made-up 0."""
    with pytest.raises(GradingConfigError, match="no such field"):
        render(template)
    with pytest.raises(GradingConfigError, match="its fields: none"):
        render("{{ item.reference_answer }}", item={})


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ item.x", "unclosed"),
        ("{{ }}", "empty"),
        ("{{ foo.bar }}", "unknown namespace 'foo'"),
        ("{{ items.x }}", "unknown namespace 'items'"),
        ("{{ 1 + 2 }}", "must start with a namespace"),
        ("{{ item.x + 1 }}", "bad variable"),
        ("{{ item.x[abc] }}", "bad variable"),
        ("{{ sample.output }}", "unknown variable 'sample.output'"),
        ("{{ sample.final_answer }}", "unknown variable"),
        ("{{ rollout }}", "needs a variable"),
        ("{{ rollout.calls_made }}", "unknown variable 'rollout.calls_made'"),
        ("{{ item.a {{ item.b }}", "inside"),
    ],
)
def test_bad_templates_are_refused(template: str, message: str) -> None:
    with pytest.raises(TemplateError, match=message.replace("(", r"\(").replace("+", r"\+")):
        compile_template(template)


def test_known_variables_compile() -> None:
    for text in [
        "{{ item }}",
        "{{ item.anything.at.all }}",
        "{{ sample.output_json }}",
        "{{ sample.output_reasoning_summary }}",
        "{{ rollout.tool_calls }} {{ rollout.calls[0].name }} {{ rollout.tools_used }} {{ rollout.errors }}",
        "{{ rollout.duration_s }} {{ rollout.parallel_batches }} {{ rollout.state.demo.notes }}",
    ]:
        compile_template(text)


def test_uses_rollout() -> None:
    assert compile_template("{{ rollout.tool_calls }}").uses_rollout
    assert not compile_template("{{ item.x }} {{ sample.output_text }}").uses_rollout


def test_rollout_namespace() -> None:
    record = rollout(
        [
            call("search", {"q": "jacket"}, '{"hits": 3}'),
            # two calls overlapping in time: one parallel batch
            call("get_item", {"id": 1}, "item 1", start=1.0, duration=0.5),
            call("get_item", {"id": 2}, "Error: not found", outcome="model_error", start=1.1, duration=0.5),
            call("checkout", {}, "", outcome="infra_error", start=2.0, duration=1.0),
        ],
        state={"retail": {"orders": {"W1": {"status": "cancelled"}}}},
    )
    namespace = rollout_namespace(record)
    assert namespace["tool_calls"] == 4
    assert namespace["tools_used"] == ["checkout", "get_item", "search"]
    assert namespace["errors"] == 2
    assert namespace["parallel_batches"] == 3
    assert namespace["duration_s"] == pytest.approx(3.0)
    assert namespace["calls"][1] == {
        "name": "get_item",
        "arguments": {"id": 1},
        "output": "item 1",
        "outcome": "ok",
    }
    assert namespace["state"] == {"retail": {"orders": {"W1": {"status": "cancelled"}}}}

    scope = Scope(sample={}, item={}, record=record)
    assert compile_template("{{ rollout.tool_calls }}/{{ rollout.errors }}").render(scope) == "4/2"
    assert compile_template("{{ rollout.tools_used }}").render(scope) == '["checkout","get_item","search"]'
    assert compile_template("{{ rollout.calls[0].arguments.q }}").render(scope) == "jacket"
    assert compile_template("{{ rollout.state.retail.orders.W1.status }}").render(scope) == "cancelled"


def test_rollout_namespace_without_a_rollout() -> None:
    empty = rollout_namespace(None)
    assert empty == {
        "tool_calls": 0,
        "calls": [],
        "tools_used": [],
        "errors": 0,
        "duration_s": 0.0,
        "parallel_batches": 0,
        "state": {},
    }
    scope = Scope(sample={}, item={})
    assert compile_template("{{ rollout.tool_calls }} {{ rollout.calls }}").render(scope) == "0 []"
