"""Grader templates: `{{ item.x }}`, `{{ sample.output_tools[0].function.name }}`, `{{ rollout.tool_calls }}`.

A template is parsed once, when the config is loaded: a syntax error, an unknown namespace or an unknown
`sample.` / `rollout.` variable is a config error then. At grading time a path that is missing from the
data renders as an empty string (as on the platform); a string renders as itself, `null` as an empty
string, and any other value as compact JSON.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import orjson

from app.grading.graders.model import GradeInput, RolloutRecord
from app.sdk import GradingConfigError

NAMESPACES = ("item", "sample", "rollout")

# What the platform puts in `sample` (contract §4); anything else is a typo we can catch at start-up.
SAMPLE_VARIABLES = frozenset(
    {"output_text", "output_json", "output_tools", "output_reasoning_summary", "choices"}
)

# What the server recorded for the rollout, as `rollout.<name>`.
ROLLOUT_VARIABLES = {
    "tool_calls": "number of calls",
    "calls": "list of {name, arguments, output, outcome}",
    "tools_used": "sorted distinct tool names",
    "errors": "number of calls whose outcome is not ok",
    "duration_s": "seconds from the first call's start to the last call's end",
    "parallel_batches": "number of batches of calls that overlapped in time",
    "state": "final state: {pack: {collection: {key: record}}}",
}

_OPEN, _CLOSE = "{{", "}}"
_SEGMENT = re.compile(
    r"""\.(?P<name>[^.\[\]\s]+)          # .key (or .0 on a list)
      | \[\s*(?P<index>-?\d+)\s*\]       # [0]
      | \[\s*(?P<quote>["'])(?P<key>.*?)(?P=quote)\s*\]  # ["key with spaces"]
    """,
    re.VERBOSE,
)
_HEAD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class TemplateError(ValueError):
    """A template that cannot be compiled; the message says what is wrong."""


@dataclass(frozen=True)
class Ref:
    """One `{{ namespace.path }}` reference."""

    text: str
    namespace: str
    path: tuple[str | int, ...]


@dataclass(frozen=True)
class Template:
    source: str
    parts: tuple[str | Ref, ...]

    @property
    def refs(self) -> tuple[Ref, ...]:
        return tuple(p for p in self.parts if isinstance(p, Ref))

    @property
    def uses_rollout(self) -> bool:
        return any(r.namespace == "rollout" for r in self.refs)

    def render(self, scope: Scope) -> str:
        if len(self.parts) == 1 and isinstance(self.parts[0], str):
            return self.parts[0]
        return "".join(p if isinstance(p, str) else render_value(scope.lookup(p)) for p in self.parts)


def compile_template(source: str) -> Template:
    """Parse a template; raises TemplateError for a syntax error or an unknown variable."""
    parts: list[str | Ref] = []
    position = 0
    while True:
        start = source.find(_OPEN, position)
        if start < 0:
            if position < len(source):
                parts.append(source[position:])
            break
        end = source.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            raise TemplateError(f"unclosed '{{{{' at character {start}: {_excerpt(source, start)}")
        if start > position:
            parts.append(source[position:start])
        parts.append(_parse_ref(source[start + len(_OPEN) : end]))
        position = end + len(_CLOSE)
    return Template(source=source, parts=tuple(parts))


def _excerpt(source: str, at: int) -> str:
    return repr(source[at : at + 40])


def _parse_ref(expression: str) -> Ref:
    text = expression.strip()
    if not text:
        raise TemplateError("empty '{{ }}': write a variable such as {{ item.reference_answer }}")
    if "{{" in text:
        raise TemplateError(f"'{{{{' inside '{{{{ {text} }}}}'")
    head = _HEAD.match(text)
    if head is None:
        raise TemplateError(
            f"bad variable '{text}': it must start with a namespace ({', '.join(NAMESPACES)})"
        )
    namespace = head.group(0)
    if namespace not in NAMESPACES:
        raise TemplateError(
            f"unknown namespace {namespace!r} in '{text}': only {', '.join(NAMESPACES)} are allowed"
        )
    path: list[str | int] = []
    position = head.end()
    while position < len(text):
        match = _SEGMENT.match(text, position)
        if match is None:
            raise TemplateError(f"bad variable '{text}': cannot read {text[position:]!r}")
        if match.group("name") is not None:
            path.append(match.group("name"))
        elif match.group("index") is not None:
            path.append(int(match.group("index")))
        else:
            path.append(match.group("key"))
        position = match.end()
    _check_variable(namespace, path, text)
    return Ref(text=text, namespace=namespace, path=tuple(path))


def _check_variable(namespace: str, path: Sequence[str | int], text: str) -> None:
    first = path[0] if path else None
    if namespace == "sample" and first is not None and first not in SAMPLE_VARIABLES:
        raise TemplateError(f"unknown variable '{text}': sample has {', '.join(sorted(SAMPLE_VARIABLES))}")
    if namespace == "rollout":
        if first is None:
            raise TemplateError(f"'{text}' needs a variable: rollout.{{{', '.join(ROLLOUT_VARIABLES)}}}")
        if first not in ROLLOUT_VARIABLES:
            raise TemplateError(f"unknown variable '{text}': rollout has {', '.join(ROLLOUT_VARIABLES)}")


_MISSING = object()


def resolve(root: Any, path: Sequence[str | int]) -> Any:
    """Follow a path through mappings and lists; `_MISSING` if any step is absent."""
    value = root
    for step in path:
        if isinstance(value, Mapping):
            if step in value:
                value = value[step]
            elif isinstance(step, int) and str(step) in value:
                value = value[str(step)]
            else:
                return _MISSING
        elif isinstance(value, list | tuple):
            index = step if isinstance(step, int) else _as_index(step)
            if index is None or not -len(value) <= index < len(value):
                return _MISSING
            value = value[index]
        else:
            return _MISSING
    return value


def _as_index(step: str) -> int | None:
    return int(step) if re.fullmatch(r"-?\d+", step) else None


def render_value(value: Any) -> str:
    if value is _MISSING or value is None:
        return ""
    if isinstance(value, str):
        return value
    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


def rollout_namespace(record: RolloutRecord | None) -> dict[str, Any]:
    """The `rollout` namespace (also what a three-argument python grader receives)."""
    if record is None or not record.calls:
        return {
            "tool_calls": 0,
            "calls": [],
            "tools_used": [],
            "errors": 0,
            "duration_s": 0.0,
            "parallel_batches": 0,
            "state": _plain(record.state) if record is not None else {},
        }
    calls = record.calls
    started = min(c.started_at for c in calls)
    ended = max(c.ended_at for c in calls)
    return {
        "tool_calls": len(calls),
        "calls": [
            {
                "name": c.tool,
                "arguments": c.parsed_arguments(),
                "output": c.output or "",
                "outcome": c.outcome,
            }
            for c in calls
        ],
        "tools_used": sorted({c.tool for c in calls}),
        "errors": sum(1 for c in calls if c.outcome != "ok"),
        "duration_s": max(0.0, (ended - started).total_seconds()),
        "parallel_batches": len({c.batch for c in calls}),
        "state": _plain(record.state),
    }


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@dataclass
class Scope:
    """The data templates read for one grade; the rollout namespace is built on first use."""

    sample: Mapping[str, Any]
    item: Mapping[str, Any]
    record: RolloutRecord | None = None

    @classmethod
    def of(cls, inp: GradeInput) -> Scope:
        return cls(sample=inp.sample, item=inp.item, record=inp.rollout)

    @cached_property
    def rollout(self) -> dict[str, Any]:
        return rollout_namespace(self.record)

    def lookup(self, ref: Ref) -> Any:
        root: Any
        if ref.namespace == "item":
            # The dataset row is the operator's: a field the config reads and the row lacks is a
            # configuration error, not an empty string to score against (a missing sample field is
            # the model's answer lacking it, and renders empty).
            value = resolve(self.item, ref.path)
            if value is _MISSING:
                raise GradingConfigError(
                    f"the grader reads {ref.text.strip()!r} and the item has no such field "
                    f"(its fields: {', '.join(sorted(map(str, self.item))) or 'none'})"
                )
            return value
        if ref.namespace == "sample":
            root = self.sample
        else:
            if self.record is not None and ref.path[:1] == ("state",):
                self.record.require_state()
            root = self.rollout
        return resolve(root, ref.path)
