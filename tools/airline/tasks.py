"""The airline tasks (scenarios, gold actions, reward basis, splits) and replays through its tools."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from pydantic import Field

from app.sdk import Base
from tools.airline import data
from tools.airline.tools import pack
from tools.retail.tasks import (
    SPLITS,
    EvaluationCriteria,
    Replay,
    RetailTask,
    Split,
    ToolCall,
    gold_calls,
    parse_tasks,
)
from tools.retail.tasks import replay as replay_with

__all__ = ["SPLITS", "AirlineTask", "Split", "ToolCall", "gold_calls", "replay", "replay_calls"]

# τ²-bench's default reward basis: the final database and what the agent told the customer. Every
# airline task of 26.3 leaves it to the default.
DEFAULT_REWARD_BASIS = ("DB", "COMMUNICATE")


class AirlineCriteria(EvaluationCriteria):
    reward_basis: list[str] = Field(default_factory=lambda: list(DEFAULT_REWARD_BASIS))


class AirlineTask(RetailTask):
    """One τ²-bench airline task (tasks have the same shape in every τ²-bench domain) and its reward basis."""

    evaluation_criteria: AirlineCriteria


@lru_cache(maxsize=2)
def load_tasks(directory: Path) -> dict[str, AirlineTask]:
    """Every airline task (50) of the data `directory`, by task id, in file order. Cached: do not modify."""
    return parse_tasks(data.read_json(directory, "tasks.json"), AirlineTask, data.AirlineDataError)


def get_task(directory: Path, task_id: str) -> AirlineTask:
    task = load_tasks(directory).get(task_id)
    if task is None:
        raise KeyError(f"no airline task with id {task_id!r}")
    return task


def split_task_ids(directory: Path, split: Split) -> list[str]:
    """The task ids of a split as τ²-bench defines it (train 30, test 20)."""
    splits = data.read_json(directory, "split_tasks.json")
    if split not in SPLITS or split not in splits:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return [str(task_id) for task_id in splits[split]]


def replay_calls(task: AirlineTask) -> list[ToolCall]:
    """The gold calls of a task, for replaying it by hand or over HTTP. Unlike the retail grader, the
    airline grader scores a rollout without calls as τ²-bench does, so a task whose right answer changes
    nothing (its gold list is empty) is replayed as no call at all."""
    return gold_calls(task)


def replay(calls: Sequence[ToolCall], *, base: Base, trace_id: str = "replay") -> Replay:
    """Run calls through the airline tools on a fresh copy of the airline (`tools.retail.tasks.replay`)."""
    return replay_with(calls, base=base, trace_id=trace_id, tools=pack.tools)
