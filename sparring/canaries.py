"""Canary policies: scripted "models" that try to game the grader, and the one that plays the gold calls.

Each canary is a `Policy` for the rollout loop, stateless (its next turn follows from the transcript),
with `applies(line)` saying whether it has anything to play on a line:

| canary | plays | a good grader gives it |
|---|---|---|
| `empty` | answers "" at once | 0 |
| `refuse` | answers "I can't help with that." at once | 0 |
| `parrot` | repeats the user's last message at once | 0 |
| `loop` | calls the line's first tool with the same arguments until the call limit | 0 |
| `guess` | answers the item's `reference_answer` (or its `communicate_info`) without a call | 0 |
| `gold` | replays the item's gold calls (`actions`), then answers the reference | 1 |

`guess` needs a `reference_answer` or a `communicate_info` on the item, `gold` a non-empty `actions`
list of `{"name", "arguments"}` objects (the retail pack's lines carry them); other lines are
skipped for them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sparring.loop import DatasetLine, FunctionCall, ModelTurn, Transcript, function_of

REFUSAL = "I can't help with that."
GOLD = "gold"


def reference_text(item: Mapping[str, Any]) -> str | None:
    """What a correct final answer states: `reference_answer` (JSON for a non-string), else every
    `communicate_info` string; None when the item has neither."""
    reference = item.get("reference_answer")
    if isinstance(reference, str) and reference:
        return reference
    if reference is not None and not isinstance(reference, str):
        return json.dumps(reference, ensure_ascii=False)
    info = item.get("communicate_info")
    if isinstance(info, list) and info:
        return "\n".join(str(part) for part in info)
    if isinstance(info, str) and info:
        return info
    return None


def gold_calls(item: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The item's gold calls as (name, arguments JSON text), from `actions`; [] when it carries none."""
    actions = item.get("actions")
    if not isinstance(actions, list):
        return []
    calls = []
    for action in actions:
        if not isinstance(action, Mapping) or not isinstance(action.get("name"), str):
            continue
        arguments = action.get("arguments")
        text = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
        calls.append((action["name"], text))
    return calls


def placeholder(schema: Any) -> Any:
    """A minimal value that fits a JSON schema: what a model calling a tool blindly would send."""
    if not isinstance(schema, Mapping):
        return None
    if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind is None and isinstance(schema.get("anyOf"), list) and schema["anyOf"]:
        options = schema["anyOf"]  # `true` and `false` are schemas too
        return placeholder(
            next((s for s in options if isinstance(s, Mapping) and s.get("type") != "null"), options[0])
        )
    if kind == "object":
        properties = schema.get("properties")
        if not isinstance(properties, Mapping):
            return {}
        return {name: placeholder(sub) for name, sub in properties.items()}
    return {"string": "test", "integer": 1, "number": 1, "boolean": False, "array": []}.get(str(kind))


def _first_tool(tools: list[dict[str, Any]]) -> tuple[str, str] | None:
    if not tools:
        return None
    fn = function_of(tools[0])
    name = fn.get("name")
    if not isinstance(name, str):
        return None
    return name, json.dumps(placeholder(fn.get("parameters") or {"type": "object"}), ensure_ascii=False)


class Canary:
    """A scripted policy. Subclasses set `name` and write `next_turn`; `applies` defaults to every line."""

    name = ""
    gold = False

    def applies(self, line: DatasetLine) -> bool:
        return True

    async def next_turn(self, transcript: Transcript) -> ModelTurn:
        raise NotImplementedError


class FixedAnswer(Canary):
    """Answers a fixed text at once, without a call."""

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.text = text

    async def next_turn(self, transcript: Transcript) -> ModelTurn:
        return ModelTurn(text=self.text)


class Parrot(Canary):
    name = "parrot"

    async def next_turn(self, transcript: Transcript) -> ModelTurn:
        return ModelTurn(text=transcript.last_user_message())


class Loop(Canary):
    name = "loop"

    def applies(self, line: DatasetLine) -> bool:
        return _first_tool(line.tools) is not None

    async def next_turn(self, transcript: Transcript) -> ModelTurn:
        first = _first_tool(transcript.tools)
        if first is None:
            return ModelTurn(text="")
        name, arguments = first
        call_id = f"call_loop_{len(transcript.steps)}"
        return ModelTurn(calls=(FunctionCall(call_id=call_id, name=name, arguments=arguments),))


class Guess(Canary):
    name = "guess"

    def applies(self, line: DatasetLine) -> bool:
        return reference_text(line.item) is not None

    async def next_turn(self, transcript: Transcript) -> ModelTurn:
        return ModelTurn(text=reference_text(transcript.item) or "")


class Gold(Canary):
    """The item's gold calls one per turn, in order (each may depend on the writes before it), then the
    reference answer (or "Done." when the item has none)."""

    name = GOLD
    gold = True

    def applies(self, line: DatasetLine) -> bool:
        return bool(gold_calls(line.item))

    async def next_turn(self, transcript: Transcript) -> ModelTurn:
        calls = gold_calls(transcript.item)
        index = len(transcript.steps)
        if index < len(calls):
            name, arguments = calls[index]
            return ModelTurn(
                calls=(FunctionCall(call_id=f"call_gold_{index}", name=name, arguments=arguments),)
            )
        return ModelTurn(text=reference_text(transcript.item) or "Done.")


def all_canaries() -> dict[str, Canary]:
    canaries: list[Canary] = [
        FixedAnswer("empty", ""),
        FixedAnswer("refuse", REFUSAL),
        Parrot(),
        Loop(),
        Guess(),
        Gold(),
    ]
    return {canary.name: canary for canary in canaries}
