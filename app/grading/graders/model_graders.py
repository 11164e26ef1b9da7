"""The `score_model` and `label_model` graders: templated messages to the judge, a structured answer back.

The judge is asked for `{"steps": [{"description", "conclusion"}], "result": ...}` through a strict JSON
schema (a number for score_model, one of the labels for label_model), like the hosted graders. An
answer that is empty, not JSON, not a number or not a known label scores 0 with the problem recorded:
it says something about the judge's answer, not about the judge being down.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from app.grading.graders.model import GradeInput, GradeResult
from app.grading.graders.specs import InputImagePart, InputTextPart, MessageSpec, SamplingParamsSpec
from app.grading.graders.templates import Scope, Template, compile_template

_STEPS_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"description": {"type": "string"}, "conclusion": {"type": "string"}},
        "required": ["description", "conclusion"],
        "additionalProperties": False,
    },
}

_FENCE = re.compile(r"^```[a-zA-Z]*\s*(.*?)\s*```$", re.DOTALL)


class ChatJudge(Protocol):
    async def chat(
        self,
        *,
        model: str,
        messages: Sequence[dict[str, Any]],
        params: dict[str, Any],
        response_format: dict[str, Any] | None,
    ) -> str | None: ...


def _response_format(name: str, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {
            "name": name,
            "strict": True,
            "schema": {
                "type": "object",
                "properties": {"steps": _STEPS_SCHEMA, "result": result},
                "required": ["steps", "result"],
                "additionalProperties": False,
            },
        },
    }


SCORE_FORMAT = _response_format("score", {"type": "number"})


def label_format(labels: Sequence[str]) -> dict[str, Any]:
    return _response_format("label", {"type": "string", "enum": list(labels)})


@dataclass(frozen=True)
class _Part:
    kind: str  # text | image
    template: Template
    detail: str | None = None


@dataclass(frozen=True)
class CompiledMessage:
    role: str
    parts: tuple[_Part, ...]
    as_text: bool  # the config gave a plain string: send a plain string

    @property
    def uses_rollout(self) -> bool:
        return any(p.template.uses_rollout for p in self.parts)

    def render(self, scope: Scope) -> dict[str, Any]:
        if self.as_text:
            return {"role": self.role, "content": self.parts[0].template.render(scope)}
        content: list[dict[str, Any]] = []
        for part in self.parts:
            if part.kind == "text":
                content.append({"type": "text", "text": part.template.render(scope)})
            else:
                image: dict[str, Any] = {"url": part.template.render(scope)}
                if part.detail:
                    image["detail"] = part.detail
                content.append({"type": "image_url", "image_url": image})
        return {"role": self.role, "content": content}


def _plain_compile(text: str, field: str) -> Template:
    return compile_template(text)


def compile_messages(
    messages: Sequence[MessageSpec], template: Callable[[str, str], Template] = _plain_compile
) -> list[CompiledMessage]:
    """Compile every template of the input messages with `template(text, field path)`."""
    compiled = []
    for index, message in enumerate(messages):
        content, field = message.content, f"input.{index}.content"
        if isinstance(content, str):
            compiled.append(CompiledMessage(message.role, (_Part("text", template(content, field)),), True))
            continue
        if isinstance(content, list):
            parts = tuple(_compile_part(p, template, f"{field}.{n}") for n, p in enumerate(content))
        else:
            parts = (_compile_part(content, template, field),)
        compiled.append(CompiledMessage(message.role, parts, False))
    return compiled


def _compile_part(
    part: InputTextPart | InputImagePart, template: Callable[[str, str], Template], field: str
) -> _Part:
    if isinstance(part, InputTextPart):
        return _Part("text", template(part.text, f"{field}.text"))
    return _Part("image", template(part.image_url, f"{field}.image_url"), part.detail)


def chat_params(sampling: SamplingParamsSpec | None) -> dict[str, Any]:
    """The platform's sampling_params as chat-completions arguments (only those that are set)."""
    if sampling is None:
        return {}
    params: dict[str, Any] = {}
    if sampling.temperature is not None:
        params["temperature"] = sampling.temperature
    if sampling.top_p is not None:
        params["top_p"] = sampling.top_p
    if sampling.seed is not None:
        params["seed"] = sampling.seed
    if sampling.max_completions_tokens is not None:
        params["max_completion_tokens"] = sampling.max_completions_tokens
    if sampling.reasoning_effort is not None:
        params["reasoning_effort"] = sampling.reasoning_effort
    return params


def judge_result(content: str | None) -> tuple[Any, str | None]:
    """The `result` of a judge answer, or an error saying why there is none."""
    if content is None or not content.strip():
        return None, "the judge gave an empty answer"
    text = content.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None, f"the judge's answer is not JSON: {_excerpt(content)}"
    if isinstance(data, dict):
        if "result" not in data:
            return None, f"the judge's answer has no 'result': {_excerpt(content)}"
        return data["result"], None
    return data, None  # a bare value, from a server that ignored the schema


def as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def _excerpt(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


class _ModelGrader:
    def __init__(
        self,
        *,
        name: str,
        version: str,
        judge: ChatJudge,
        model: str,
        messages: list[CompiledMessage],
        params: dict[str, Any],
    ) -> None:
        self.name = name
        self.version = version
        self.judge = judge
        self.model = model
        self.messages = messages
        self.params = params
        self.needs_rollout = any(m.uses_rollout for m in messages)

    async def _ask(self, inp: GradeInput, response_format: dict[str, Any]) -> tuple[Any, str | None]:
        scope = Scope.of(inp)
        rendered = [m.render(scope) for m in self.messages]
        content = await self.judge.chat(
            model=self.model, messages=rendered, params=self.params, response_format=response_format
        )
        return judge_result(content)


class ScoreModelGrader(_ModelGrader):
    def __init__(self, *, score_range: tuple[float, float], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.low, self.high = score_range

    async def grade(self, inp: GradeInput) -> GradeResult:
        result, error = await self._ask(inp, SCORE_FORMAT)
        if error is not None:
            return GradeResult.failed(error)
        number = as_number(result)
        if number is None:
            return GradeResult.failed(f"the judge's result is not a number: {result!r}"[:300])
        return GradeResult(score=min(max(number, self.low), self.high))


class LabelModelGrader(_ModelGrader):
    def __init__(self, *, labels: Sequence[str], passing_labels: Sequence[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.labels = list(labels)
        self.passing = frozenset(passing_labels)
        self.format = label_format(self.labels)

    async def grade(self, inp: GradeInput) -> GradeResult:
        result, error = await self._ask(inp, self.format)
        if error is not None:
            return GradeResult.failed(error)
        label = result.strip() if isinstance(result, str) else result
        if label not in self.labels:
            return GradeResult.failed(f"the judge's label {label!r} is not one of {self.labels}"[:300])
        return GradeResult(score=1.0 if label in self.passing else 0.0)
