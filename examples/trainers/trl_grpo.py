"""TRL GRPO against sparring: `environment_factory` with one sparring rollout per episode.

Written against TRL's documented `GRPOTrainer(environment_factory=...)` contract (TRL 1.x, see its
"OpenEnv Integration" guide): the trainer makes one instance per generation, calls `reset(**row)`
with the dataset row, exposes every public method as a tool (schema from the signature and a
Google-style docstring), runs the multi-turn tool loop itself, and hands the instances to the reward
functions. Here each method is built from the schemas sparring serves, so the model sees exactly the
tools and descriptions of the pack, and every call lands in sparring's log under the episode's trace.

    SPARRING_URL=https://sparring.example.com SPARRING_KEY=... python trl_grpo.py
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from sparring.client import Environment, Rollout

SPARRING = Environment(
    os.environ["SPARRING_URL"],
    os.environ["SPARRING_KEY"],
    grader_key=os.environ.get("SPARRING_GRADER_KEY"),
    run="trl-grpo",
    pack="retail",  # retail's tools, at its routes: its shared names too, with other packs enabled
)
GRADER = "retail"
JSON_TYPES: dict[str, type] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "array": list,
    "object": dict,
}


def _python_type(schema: dict[str, Any]) -> type:
    kinds = schema.get("type", "string")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    kind = next((k for k in kinds if k != "null"), "string")
    return JSON_TYPES.get(kind, str)


def tool_method(tool: dict[str, Any]) -> Any:
    """A method calling sparring's tool, with the signature and docstring TRL reads for its schema."""
    function = tool["function"]
    name = function["name"]
    properties: dict[str, Any] = function["parameters"].get("properties", {})

    def method(self: SparringEpisode, **arguments: Any) -> str:
        return self.rollout.call(name, arguments)

    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        inspect.Parameter(arg, inspect.Parameter.KEYWORD_ONLY, annotation=_python_type(spec))
        for arg, spec in properties.items()
    ]
    method.__signature__ = inspect.Signature(parameters, return_annotation=str)  # type: ignore[attr-defined]
    method.__annotations__ = {arg: _python_type(spec) for arg, spec in properties.items()} | {"return": str}
    args = "".join(f"    {arg}: {spec.get('description') or arg}\n" for arg, spec in properties.items())
    method.__doc__ = f"{function['description']}\n\nArgs:\n{args}\nReturns:\n    The tool's output."
    method.__name__ = name
    return method


class SparringEpisode:
    """One episode: a sparring rollout (its own trace id and state); tools are added below."""

    def __init__(self) -> None:
        self.rollout: Rollout = SPARRING.rollout()

    def reset(self, **row: Any) -> str | None:
        # Every dataset column but the prompt is the item: what the tools and the grader read.
        self.rollout = SPARRING.rollout(item={k: v for k, v in row.items() if k != "prompt"})
        return None


for schema in SPARRING.tools():
    setattr(SparringEpisode, schema["function"]["name"], tool_method(schema))


def sparring_reward(environments: list[SparringEpisode], completions: list[Any], **_: Any) -> list[float]:
    """The `retail` grade of each episode's final answer (its final database state, by trace id)."""
    rewards = []
    for episode, completion in zip(environments, completions, strict=True):
        answer = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        rewards.append(episode.rollout.grade(GRADER, answer or ""))
    return rewards


def load_dataset(path: str) -> Dataset:
    """`sparring dataset build retail --split train --out train.jsonl`, as TRL's conversational prompts."""
    rows = []
    with open(path) as lines:
        for line in map(json.loads, lines):
            prompt = [
                {**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in line["messages"]
            ]
            rows.append(
                {"prompt": prompt, **{k: v for k, v in line.items() if k not in ("messages", "tools")}}
            )
    return Dataset.from_list(rows)


if __name__ == "__main__":
    trainer = GRPOTrainer(
        model="Qwen/Qwen3-0.6B",
        train_dataset=load_dataset("train.jsonl"),
        reward_funcs=sparring_reward,
        args=GRPOConfig(max_completion_length=4096, chat_template_kwargs={"enable_thinking": False}),
        environment_factory=SparringEpisode,
    )
    trainer.train()
