"""Grader configs as pydantic models, one per `type`, and the parser that says which field is wrong.

The OpenAI-compatible types take the fields of the hosted graders (a config that validates there
validates here); the trace-aware types are ours. Unknown fields are refused, so a typo is a start-up
error instead of a silently ignored setting.
"""

from __future__ import annotations

import hashlib
import keyword
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from app.grading.graders.formula import FUNCTIONS

MAX_PYTHON_SOURCE = 256 * 1024  # the hosted limit

OPENAI_TYPES = ("string_check", "text_similarity", "score_model", "label_model", "python", "multi")
TRACE_TYPES = ("tool_budget", "no_loops", "grounded", "required_tools", "forbidden_tools", "state_check")

Metric = Literal[
    "fuzzy_match",
    "bleu",
    "gleu",
    "meteor",
    "cosine",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
]

NonEmpty = Annotated[str, Field(min_length=1)]


class SpecError(ValueError):
    """A config field that is wrong: `field` is its dotted path inside the grader config."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None  # informational, as on the platform; graders are served by their key


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


# --- OpenAI-compatible types ---------------------------------------------------------------------------


class StringCheckSpec(_Spec):
    type: Literal["string_check"]
    operation: Literal["eq", "ne", "like", "ilike"]
    input: str
    reference: str


class TextSimilaritySpec(_Spec):
    type: Literal["text_similarity"]
    input: str
    reference: str
    evaluation_metric: Metric
    pass_threshold: float | None = None  # kept for compatibility; the score is the metric's value
    # Ours: the embeddings model for `cosine` (the hosted grader picks its own).
    embedding_model: NonEmpty = "text-embedding-3-small"

    _check_threshold = field_validator("pass_threshold")(_finite)


class InputTextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["input_text", "output_text"]
    text: str


class InputImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None


ContentPart = Annotated[InputTextPart | InputImagePart, Field(discriminator="type")]


class MessageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | ContentPart | list[ContentPart]
    type: Literal["message"] | None = None


class SamplingParamsSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    max_completions_tokens: int | None = Field(None, ge=1)  # sic: the platform's spelling
    reasoning_effort: str | None = None


class _ModelGraderSpec(_Spec):
    model: NonEmpty
    input: list[MessageSpec] = Field(min_length=1)


class ScoreModelSpec(_ModelGraderSpec):
    type: Literal["score_model"]
    range: tuple[float, float] = (0.0, 1.0)
    pass_threshold: float | None = None
    sampling_params: SamplingParamsSpec | None = None

    @field_validator("range")
    @classmethod
    def _check_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
            raise ValueError("must be two finite numbers [low, high] with low < high")
        return value


class LabelModelSpec(_ModelGraderSpec):
    type: Literal["label_model"]
    labels: list[NonEmpty] = Field(min_length=1)
    passing_labels: list[NonEmpty] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_labels(self) -> LabelModelSpec:
        if len(set(self.labels)) != len(self.labels):
            raise ValueError("labels must be distinct")
        outside = [label for label in self.passing_labels if label not in self.labels]
        if outside:
            raise ValueError(f"passing_labels {outside} are not in labels {self.labels}")
        return self


class PythonSpec(_Spec):
    type: Literal["python"]
    source: str = Field(min_length=1, max_length=MAX_PYTHON_SOURCE)
    image_tag: str | None = None  # accepted for compatibility; there is one interpreter here
    pass_threshold: float | None = None


# --- trace-aware types (ours) --------------------------------------------------------------------------


class ToolBudgetSpec(_Spec):
    """1 up to `max_calls` answered calls; each call over the budget multiplies the score by `decay`."""

    type: Literal["tool_budget"]
    max_calls: int = Field(ge=0)
    decay: float = Field(0.8, ge=0, le=1)


class NoLoopsSpec(_Spec):
    """The share of answered calls that are not repeats of an earlier identical call."""

    type: Literal["no_loops"]
    allowed_repeats: int = Field(0, ge=0)  # identical calls tolerated before they count (polling tools)
    same_output_only: bool = False  # count a repeat only if it also got the same output (nothing new)


class GroundedSpec(_Spec):
    """The share of the answer's numbers and quoted strings found in a tool output of the rollout."""

    type: Literal["grounded"]
    input: str | None = None  # template of the text to check; the final answer when absent
    include_prompt: bool = True  # the item's messages also ground (a user's own order number)
    ignore_numbers_below: float = Field(10, ge=0)  # small integers are usually counts, not read facts


class RequiredToolsSpec(_Spec):
    type: Literal["required_tools"]
    tools: list[NonEmpty] = Field(min_length=1)


class ForbiddenToolsSpec(_Spec):
    type: Literal["forbidden_tools"]
    tools: list[NonEmpty] = Field(min_length=1)


class StateCheckSpec(_Spec):
    type: Literal["state_check"]
    check: NonEmpty


SubGraderSpec = (
    StringCheckSpec
    | TextSimilaritySpec
    | ScoreModelSpec
    | LabelModelSpec
    | PythonSpec
    | ToolBudgetSpec
    | NoLoopsSpec
    | GroundedSpec
    | RequiredToolsSpec
    | ForbiddenToolsSpec
    | StateCheckSpec
)


class MultiSpec(_Spec):
    type: Literal["multi"]
    graders: dict[str, Annotated[SubGraderSpec, Field(discriminator="type")]] = Field(min_length=1)
    calculate_output: NonEmpty


GraderSpec = SubGraderSpec | MultiSpec

SPEC_TYPES: dict[str, type[BaseModel]] = {
    "string_check": StringCheckSpec,
    "text_similarity": TextSimilaritySpec,
    "score_model": ScoreModelSpec,
    "label_model": LabelModelSpec,
    "python": PythonSpec,
    "multi": MultiSpec,
    "tool_budget": ToolBudgetSpec,
    "no_loops": NoLoopsSpec,
    "grounded": GroundedSpec,
    "required_tools": RequiredToolsSpec,
    "forbidden_tools": ForbiddenToolsSpec,
    "state_check": StateCheckSpec,
}


def parse_spec(raw: Any, *, nested: bool = False) -> GraderSpec:
    """Validate one grader config; raise SpecError naming the field (a dotted path) and the problem."""
    if not isinstance(raw, Mapping):
        raise SpecError("", f"a grader config must be a mapping, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind is None:
        raise SpecError("type", f"missing; one of {', '.join(SPEC_TYPES)}")
    if kind not in SPEC_TYPES:
        raise SpecError("type", f"unknown grader type {kind!r}; expected one of {', '.join(SPEC_TYPES)}")
    if kind == "multi":
        if nested:
            raise SpecError("type", "a multi grader cannot contain another multi grader")
        return _parse_multi(raw)
    return _validate(SPEC_TYPES[kind], raw)  # type: ignore[return-value]


def _parse_multi(raw: Mapping[str, Any]) -> MultiSpec:
    graders = raw.get("graders")
    if not isinstance(graders, Mapping) or not graders:
        raise SpecError("graders", "must be a non-empty mapping of name -> grader config")
    parsed: dict[str, SubGraderSpec] = {}
    for key, sub in graders.items():
        if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
            raise SpecError(
                f"graders.{key}",
                "a sub-grader name must be an identifier (letters, digits, _) to be used in calculate_output",
            )
        if key in FUNCTIONS:
            raise SpecError(f"graders.{key}", f"{key!r} is a formula function; name the sub-grader otherwise")
        try:
            parsed[key] = parse_spec(sub, nested=True)  # type: ignore[assignment]
        except SpecError as exc:
            raise SpecError(_join(f"graders.{key}", exc.field), exc.message) from None
    return _validate(MultiSpec, {**raw, "graders": parsed})  # type: ignore[return-value]


def _join(prefix: str, field: str) -> str:
    return f"{prefix}.{field}" if field else prefix


def _validate(model: type[BaseModel], raw: Mapping[str, Any]) -> BaseModel:
    try:
        return model.model_validate(dict(raw))
    except ValidationError as exc:
        # In a union every member reports; the deepest error is the one about what was meant.
        error = max(exc.errors(include_url=False), key=lambda e: len(e["loc"]))
        loc = [str(part) for part in error["loc"] if not _is_type_label(part)]
        kind = error["type"]
        if kind == "extra_forbidden":
            allowed = ", ".join(model.model_fields)
            message = f"unknown field (the fields of {raw.get('type')!r} are {allowed})"
        elif kind == "missing":
            message = "required field is missing"
        else:
            message = error["msg"].removeprefix("Value error, ")
            given = error.get("input")
            if given is not None and not isinstance(given, dict | list) and kind != "value_error":
                message += f" (got {given!r})"
        raise SpecError(".".join(loc), message) from None


_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "list", "dict", "tuple", "none"})


def _is_type_label(part: object) -> bool:
    """pydantic names union members in error locations (`str`, `list[...]`); they are not fields."""
    return isinstance(part, str) and (part in _TYPE_LABELS or "[" in part or part.startswith("function-"))


def spec_version(spec: BaseModel, *extra: str) -> str:
    """A stable hash of the normalized config (defaults included, the informational name left out)."""
    data = spec.model_dump(mode="json", exclude={"name"})
    digest = hashlib.sha256(orjson.dumps(data, option=orjson.OPT_SORT_KEYS))
    for part in extra:
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]
