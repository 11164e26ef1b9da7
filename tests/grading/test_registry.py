"""Building graders at start-up: config errors that name file, grader and field; files; examples; versions."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from openai.types.graders import (
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from openai.types.graders.multi_grader import Graders as MultiSubGraders
from pydantic import BaseModel, SecretStr, TypeAdapter

from app.config import Settings
from app.grading.graders.judge import JudgeSettings
from app.grading.graders.model import Grader, GraderConfigError, GradeResult, final_answer
from app.grading.graders.registry import GraderContext, build_graders, load_graders_file
from tests.grading.records import grade_input

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "graders"

SDK_TYPES: dict[str, type[BaseModel]] = {
    "string_check": StringCheckGrader,
    "text_similarity": TextSimilarityGrader,
    "score_model": ScoreModelGrader,
    "label_model": LabelModelGrader,
    "python": PythonGrader,
}
# Fields the hosted API takes that the SDK's models (3.57.0) do not declare.
PLATFORM_ONLY_FIELDS = {"pass_threshold"}


def exact(**overrides: Any) -> dict[str, Any]:
    return {
        "type": "string_check",
        "operation": "eq",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.answer }}",
        **overrides,
    }


def refused(context: GraderContext, configs: dict[str, Any]) -> GraderConfigError:
    with pytest.raises(GraderConfigError) as caught:
        build_graders(configs, source="graders.yaml", context=context)
    return caught.value


def test_the_error_reads_file_grader_field_message() -> None:
    error = GraderConfigError(
        "unknown variable 'item.foo'", source="graders.yaml", grader="exact", field="reference"
    )
    assert str(error) == "graders.yaml: grader 'exact', field 'reference': unknown variable 'item.foo'"
    assert str(GraderConfigError("not valid YAML", source="g.yaml", grader="")) == "g.yaml: not valid YAML"
    assert str(GraderConfigError("bad", source="code", grader="x")) == "code: grader 'x': bad"


@pytest.mark.parametrize(
    ("config", "field", "message"),
    [
        ({"type": "string_chek"}, "type", "unknown grader type 'string_chek'; expected one of string_check"),
        ({"operation": "eq"}, "type", "missing"),
        ("not a mapping", "", "must be a mapping"),
        (exact(refrence="x"), "refrence", "unknown field (the fields of 'string_check' are"),
        ({"type": "string_check", "operation": "eq", "input": "x"}, "reference", "required field is missing"),
        (exact(operation="contains"), "operation", "'eq', 'ne', 'like' or 'ilike'"),
        (exact(reference="{{ item.answer "), "reference", "unclosed"),
        (exact(reference="{{ itme.answer }}"), "reference", "unknown namespace 'itme'"),
        (exact(input="{{ sample.output }}"), "input", "unknown variable 'sample.output'"),
        (exact(input="{{ rollout.calls_count }}"), "input", "unknown variable 'rollout.calls_count'"),
        (
            {"type": "text_similarity", "input": "a", "reference": "b", "evaluation_metric": "jaccard"},
            "evaluation_metric",
            "Input should be",
        ),
        (
            {
                "type": "score_model",
                "model": "m",
                "input": [{"role": "system", "content": "ok"}, {"role": "user", "content": "{{ item.x"}],
            },
            "input.1.content",
            "unclosed",
        ),
        (
            {
                "type": "label_model",
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "{{ foo }}"}]}],
                "labels": ["a"],
                "passing_labels": ["a"],
            },
            "input.0.content.0.text",
            "unknown namespace 'foo'",
        ),
        (
            {
                "type": "label_model",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "labels": ["a", "b"],
                "passing_labels": ["c"],
            },
            "",
            "passing_labels ['c'] are not in labels",
        ),
        (
            {
                "type": "score_model",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "range": [1, 0],
            },
            "range",
            "low < high",
        ),
        (
            {"type": "score_model", "model": "m", "input": [{"role": "critic", "content": "x"}]},
            "input.0.role",
            "Input should be",
        ),
        ({"type": "tool_budget", "max_calls": -1}, "max_calls", "greater than or equal to 0"),
        ({"type": "tool_budget", "max_calls": 3, "decay": 2}, "decay", "less than or equal to 1"),
        ({"type": "required_tools", "tools": []}, "tools", "at least 1 item"),
        ({"type": "grounded", "input": "{{ sample.nope }}"}, "input", "unknown variable"),
        ({"type": "python", "source": ""}, "source", "at least 1 character"),
    ],
)
def test_config_errors(judge_context: GraderContext, config: Any, field: str, message: str) -> None:
    error = refused(judge_context, {"the_grader": config})
    assert (error.source, error.grader, error.field) == ("graders.yaml", "the_grader", field)
    assert message in error.message, error.message


@pytest.mark.parametrize("name", ["", "has space", "slash/name", "x" * 65, "-leading"])
def test_grader_names_must_fit_in_a_url(context: GraderContext, name: str) -> None:
    assert "a grader name must be" in refused(context, {name: exact()}).message


def test_judge_settings_come_from_the_server_settings() -> None:
    settings = Settings(
        judge_base_url="http://judge.local/v1",
        judge_api_key=SecretStr("sk-test"),
        judge_timeout_seconds=12,
        judge_max_retries=5,
        python_grader_workers=3,
        python_grader_timeout_seconds=4,
        python_grader_memory_mb=300,
    )
    context = GraderContext.from_settings(settings)
    assert context.judge_settings == JudgeSettings(
        base_url="http://judge.local/v1", api_key="sk-test", timeout=12, max_retries=5
    )
    assert (
        context.python_settings.workers,
        context.python_settings.timeout,
        context.python_settings.memory_mb,
    ) == (
        3,
        4,
        300,
    )
    assert not GraderContext.from_settings(Settings()).judge_settings.configured


# --- files -------------------------------------------------------------------------------------------


def test_load_yaml_and_json(tmp_path: Path) -> None:
    yaml_file = tmp_path / "graders.yaml"
    yaml_file.write_text("exact:\n  type: string_check\n  operation: eq\n  input: a\n  reference: a\n")
    json_file = tmp_path / "graders.json"
    json_file.write_text(
        '{"exact": {"type": "string_check", "operation": "eq", "input": "a", "reference": "a"}}'
    )
    assert load_graders_file(yaml_file) == load_graders_file(json_file)
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    assert load_graders_file(tmp_path / "empty.yaml") == {}


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("dup.yaml", "a:\n  type: tool_budget\n  max_calls: 1\na:\n  type: no_loops\n", "duplicate key 'a'"),
        ("bad.yaml", "a: [unclosed\n", "not valid YAML"),
        ("bad.json", "{", "not valid JSON"),
        ("list.yaml", "- a\n- b\n", "must hold a mapping of grader name -> config, not a list"),
        ("scalar.yaml", "a: 3\n", "a grader config must be a mapping, not a int"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(GraderConfigError, match=message) as caught:
        load_graders_file(path)
    assert caught.value.source == str(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GraderConfigError, match="cannot read the graders file"):
        load_graders_file(tmp_path / "nope.yaml")


# --- examples ----------------------------------------------------------------------------------------


async def test_the_example_files_build(judge_context: GraderContext) -> None:
    offline = build_graders(
        load_graders_file(EXAMPLES / "graders.yaml"), source="graders.yaml", context=GraderContext()
    )
    assert {
        "exact",
        "fuzzy",
        "numeric_close",
        "budget",
        "grounded",
        "answer_and_budget",
        "careful_agent",
    } <= set(offline)
    assert not offline["exact"].needs_rollout and not offline["answer_and_budget"].needs_rollout
    assert offline["budget"].needs_rollout and offline["careful_agent"].needs_rollout
    judged = build_graders(
        load_graders_file(EXAMPLES / "judge.yaml"), source="judge.yaml", context=judge_context
    )
    assert set(judged) == {"judge", "verdict", "semantic", "judged_and_efficient"}
    assert judged["judged_and_efficient"].needs_rollout
    for grader in [*offline.values(), *judged.values()]:
        assert isinstance(grader, Grader)


async def test_example_graders_grade(context: GraderContext) -> None:
    graders = build_graders(
        load_graders_file(EXAMPLES / "graders.yaml"), source="graders.yaml", context=context
    )
    inp = grade_input("1,234.5", {"reference_answer": "1234.5"})
    assert (await graders["numeric_close"].grade(inp)).score == 1.0
    assert (
        await graders["answer_and_budget"].grade(grade_input("Paris", {"reference_answer": "Paris"}))
    ).score == 1.0


def openai_compatible_configs() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for file in ("graders.yaml", "judge.yaml"):
        for name, config in load_graders_file(EXAMPLES / file).items():
            if config["type"] in SDK_TYPES or config["type"] == "multi":
                found.append((f"{file}:{name}", config))
    return found


def _sdk_check(config: dict[str, Any]) -> None:
    model = SDK_TYPES[config["type"]].model_validate({"name": "example", **config})
    assert set(model.model_extra or {}) <= PLATFORM_ONLY_FIELDS, model.model_extra


@pytest.mark.parametrize(
    ("where", "config"), openai_compatible_configs(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_examples_parse_with_the_openai_sdk_types(where: str, config: dict[str, Any]) -> None:
    if config["type"] != "multi":
        _sdk_check(config)
        return
    # The SDK's MultiGrader declares `graders` as a single grader, while the API takes a mapping of name
    # to grader (openai/openai-java#647): check each OpenAI-type sub-grader against the SDK's union, and
    # the rest of the multi against MultiGrader with one of them in place of the mapping. Sub-graders of
    # our own types (tool_budget...) only exist here.
    adapter: TypeAdapter[Any] = TypeAdapter(MultiSubGraders)
    compatible = [sub for sub in config["graders"].values() if sub["type"] in SDK_TYPES]
    assert compatible, f"{where} has no OpenAI-type sub-grader"
    for sub in compatible:
        adapter.validate_python({"name": "sub", **sub})
        _sdk_check(sub)
    MultiGrader.model_validate({"name": "example", **config, "graders": {"name": "sub", **compatible[0]}})


def test_every_openai_type_appears_in_the_examples() -> None:
    types = {config["type"] for _, config in openai_compatible_configs()}
    assert types == {*SDK_TYPES, "multi"}


# --- versions and results ----------------------------------------------------------------------------


def versions(context: GraderContext, configs: dict[str, Any]) -> dict[str, str]:
    return {name: g.version for name, g in build_graders(configs, source="t", context=context).items()}


def test_versions_are_stable_hashes_of_the_normalized_config(context: GraderContext) -> None:
    base = versions(context, {"a": exact(), "b": {"type": "tool_budget", "max_calls": 3}})
    assert base == versions(
        context, {"a": exact(name="renamed"), "b": {"type": "tool_budget", "max_calls": 3}}
    )
    assert base["b"] == versions(context, {"b": {"type": "tool_budget", "max_calls": 3, "decay": 0.8}})["b"]
    assert base["b"] != versions(context, {"b": {"type": "tool_budget", "max_calls": 4}})["b"]
    assert base["a"] != versions(context, {"a": exact(operation="ne")})["a"]
    assert all(len(v) == 16 for v in base.values())


def test_grade_results_are_always_finite() -> None:
    result = GradeResult(score=math.nan, sub_scores={"a": math.inf, "b": 0.5})
    assert result.score == 0.0
    assert result.sub_scores == {"a": 0.0, "b": 0.5}
    assert len(result.errors) == 2
    assert GradeResult(score=1).score == 1.0 and isinstance(GradeResult(score=1).score, float)


@pytest.mark.parametrize(
    ("sample", "answer"),
    [
        ({"output_text": "text", "choices": [{"message": {"content": "other"}}]}, "text"),
        ({"choices": [{"message": {"content": "first"}}, {"message": {"content": "last"}}]}, "last"),
        (
            {
                "choices": [
                    {"message": {"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}}
                ]
            },
            "ab",
        ),
        ({"choices": [{"message": {"content": None, "tool_calls": []}}]}, ""),
        ({"choices": "garbage"}, ""),
        ({}, ""),
    ],
)
def test_final_answer(sample: dict[str, Any], answer: str) -> None:
    assert final_answer(sample) == answer
