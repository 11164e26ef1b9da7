"""The retail tasks (scenarios, gold actions, splits) and replaying calls through the pack's own tools."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.sdk import Base, RolloutState, ToolContext, ToolError, ToolSpec
from app.sdk.state import Changes
from tools.retail import data
from tools.retail.tools import pack

Split = Literal["train", "test"]
SPLITS: tuple[Split, ...] = ("train", "test")

ToolCall = tuple[str, dict[str, Any]]
"""One call as the model would make it: the tool's name and its arguments object."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class GoldAction(_Lenient):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    action_id: str | None = None


class Instructions(_Lenient):
    domain: str | None = None
    reason_for_call: str
    known_info: str | None = None
    unknown_info: str | None = None
    task_instructions: str | None = None


class UserScenario(_Lenient):
    persona: str | None = None
    instructions: Instructions


class EvaluationCriteria(_Lenient):
    actions: list[GoldAction] = Field(default_factory=list)
    communicate_info: list[str] = Field(default_factory=list)


class RetailTask(_Lenient):
    """One τ²-bench retail task: who the customer is and what they want, and what a correct agent does."""

    id: str
    user_scenario: UserScenario
    evaluation_criteria: EvaluationCriteria


T = TypeVar("T", bound="RetailTask")


def parse_tasks(raw: Any, model: type[T], error: type[Exception]) -> dict[str, T]:
    """A τ²-bench domain's parsed `tasks.json` as `model`s, by task id, in file order (every domain's
    tasks have retail's shape); `error` when it has another."""
    try:
        tasks = [model.model_validate(entry) for entry in raw]
    except ValidationError as exc:
        raise error(f"tasks.json does not have the expected shape: {exc}") from exc
    return {task.id: task for task in tasks}


def named_task(directory: Path, item: Mapping[str, Any], get: Callable[[Path, str], T]) -> T | None:
    """The task a dataset row names by its `task_id` (looked up with `get`), or None for a row without
    a known task."""
    task_id = item.get("task_id")
    if not isinstance(task_id, str):
        return None
    try:
        return get(directory, task_id)
    except KeyError:
        return None


@lru_cache(maxsize=2)
def load_tasks(directory: Path) -> dict[str, RetailTask]:
    """Every retail task (114) of the data `directory`, by task id, in file order. Cached: do not modify."""
    return parse_tasks(data.read_json(directory, "tasks.json"), RetailTask, data.RetailDataError)


def get_task(directory: Path, task_id: str) -> RetailTask:
    task = load_tasks(directory).get(task_id)
    if task is None:
        raise KeyError(f"no retail task with id {task_id!r}")
    return task


@lru_cache(maxsize=2)
def _splits_in(directory: Path) -> dict[str, list[str]]:
    raw = data.read_json(directory, "split_tasks.json")
    return {str(name): [str(task_id) for task_id in ids] for name, ids in raw.items()}


def split_task_ids(directory: Path, split: Split) -> list[str]:
    """The task ids of a split as τ²-bench defines it (train 74, test 40)."""
    splits = _splits_in(directory)
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return list(splits[split])


def gold_calls(task: RetailTask) -> list[ToolCall]:
    """The task's gold actions as (tool name, arguments) pairs, in order: what a correct agent calls."""
    return [(action.name, dict(action.arguments)) for action in task.evaluation_criteria.actions]


def replay_calls(task: RetailTask) -> list[ToolCall]:
    """The calls a correct rollout of the task makes, for replaying it by hand or over HTTP.

    The gold calls; for the tasks whose gold list is empty (nothing may change: 24 and 57), one
    read-only lookup instead, since the `retail` grader scores a rollout without any call 0.
    """
    return gold_calls(task) or [("list_all_product_types", {})]


def calls_from_actions(actions: Iterable[Mapping[str, Any]]) -> list[ToolCall]:
    """Gold actions as a dataset line carries them (`{"name", "arguments", ...}`) as (name, arguments)."""
    return [(action.name, dict(action.arguments)) for action in map(GoldAction.model_validate, actions)]


@dataclass(frozen=True)
class ReplayedCall:
    """One call of a replay and what it answered."""

    tool: str
    arguments: dict[str, Any]
    result: Any  # what the tool returned, or None after an error
    error: str | None  # the ToolError message the model would read after "Error: "


@dataclass
class Replay:
    """What replaying calls produced: the changes (only the records written) and each call's result."""

    changes: Changes
    results: list[ReplayedCall]

    def state(self, base: Base) -> RolloutState:
        """A read-only view of `base` with these changes, as a state check sees it."""
        return RolloutState(base, self.changes, writable=False)


_gold_logger = logging.LoggerAdapter(logging.getLogger("sparring.tools.retail"), {"trace_id": "replay"})


def replay(
    calls: Sequence[ToolCall],
    *,
    base: Base,
    trace_id: str = "replay",
    tools: Mapping[str, ToolSpec] | None = None,
) -> Replay:
    """Run calls one after another through a pack's own tool functions on a fresh copy of its base.

    Each call sees the changes of the calls before it; a call that fails (unknown tool, bad arguments,
    a ToolError) changes nothing, like a failed call in a rollout. `base` is the store as shipped
    (`tools.retail.tools.database(directory)`); `tools` are the retail tools unless given (another
    τ²-bench pack's, such as the airline's).
    """
    store = base
    tools = pack.tools if tools is None else tools
    changes: Changes = {}
    results: list[ReplayedCall] = []
    for name, arguments in calls:
        spec = tools.get(name)
        if spec is None:
            results.append(ReplayedCall(name, arguments, None, f"unknown tool {name!r}"))
            continue
        try:
            kwargs = spec.bind(arguments)
        except ValidationError as exc:
            results.append(ReplayedCall(name, arguments, None, f"invalid arguments: {exc}"))
            continue
        state = RolloutState(store, changes, writable=spec.mutates)
        if spec.context_param is not None:
            kwargs[spec.context_param] = ToolContext(
                trace_id=trace_id,
                call_id=None,
                tool_name=name,
                item={},
                state=state,
                logger=_gold_logger,
            )
        if spec.is_async:
            raise TypeError(f"replay runs tools synchronously; {name!r} is async")
        try:
            result = spec.fn(**kwargs)
        except ToolError as exc:
            results.append(ReplayedCall(name, arguments, None, exc.message))
            continue
        # Commit the call's writes, as the server does when a tool returns.
        for collection, records in state.writes.items():
            changes.setdefault(collection, {}).update(records)
        results.append(ReplayedCall(name, arguments, result, None))
    return Replay(changes=changes, results=results)
