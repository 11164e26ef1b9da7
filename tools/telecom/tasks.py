"""The telecom tasks (scenarios, initialization, gold actions of both sides, assertions, the base split)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from tools.retail.tasks import (
    SPLITS,
    EvaluationCriteria,
    GoldAction,
    RetailTask,
    Split,
    _Lenient,
    parse_tasks,
)
from tools.telecom import data

__all__ = ["SPLITS", "Split", "TelecomTask", "get_task", "load_tasks", "split_task_ids"]


class EnvFunctionCall(_Lenient):
    env_type: str
    func_name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class EnvAssertion(EnvFunctionCall):
    assert_value: bool = True


class TelecomAction(GoldAction):
    requestor: str = "assistant"
    compare_args: list[str] | None = None


class InitialState(_Lenient):
    initialization_actions: list[EnvFunctionCall] | None = None


class TelecomCriteria(EvaluationCriteria):
    actions: list[TelecomAction] = Field(default_factory=list)  # type: ignore[assignment]
    env_assertions: list[EnvAssertion] = Field(default_factory=list)
    reward_basis: list[str] = Field(default_factory=lambda: ["DB", "COMMUNICATE"])

    @field_validator("actions", "communicate_info", "env_assertions", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return [] if value is None else value


class TelecomTask(RetailTask):
    """One τ²-bench telecom task: the customer's scenario, how both sides start, and what a fix leaves."""

    evaluation_criteria: TelecomCriteria
    initial_state: InitialState | None = None
    ticket: str | None = None

    def initialization_actions(self) -> list[EnvFunctionCall]:
        if self.initial_state is None:
            return []
        return list(self.initial_state.initialization_actions or [])


@lru_cache(maxsize=2)
def load_tasks(directory: Path) -> dict[str, TelecomTask]:
    """Every telecom task (2,285) of the data `directory`, by id, in file order. Cached: do not modify."""
    return parse_tasks(data.read_json(directory, "tasks.json"), TelecomTask, data.TelecomDataError)


def get_task(directory: Path, task_id: str) -> TelecomTask:
    task = load_tasks(directory).get(task_id)
    if task is None:
        raise KeyError(f"no telecom task with id {task_id!r}")
    return task


def split_task_ids(directory: Path, split: Split) -> list[str]:
    """The task ids of τ²-bench's base split (train 74, test 40)."""
    splits = data.read_json(directory, "split_tasks.json")
    if split not in SPLITS or split not in splits:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return [str(task_id) for task_id in splits[split]]
