"""The `airline` grader: τ²-bench's reward on the task's reward basis (final database, facts told)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from app.sdk import CheckResult, RolloutState, RolloutView
from app.sdk.state import Changes
from tools.airline.data import AirlineData
from tools.airline.records import COLLECTIONS, canonical_record
from tools.airline.tasks import DEFAULT_REWARD_BASIS, AirlineTask, get_task, replay
from tools.airline.tools import database, pack
from tools.retail.check import (
    RetailItemError,
    differing_records,
    premature_end,
    row_expectations,
    row_task,
    told,
)
from tools.retail.tasks import ToolCall

NO_TOOL_CALLS = "no_tool_calls"
# The parts of τ²-bench's reward this grader computes: DB (the final database against the gold one;
# ENV_ASSERTION counts with it, and no airline task has env assertions) and COMMUNICATE.
ENV_BASES = frozenset({"DB", "ENV_ASSERTION"})
SUPPORTED_BASES = ENV_BASES | {"COMMUNICATE"}


class AirlineItemError(RetailItemError):
    """The row sent to the grader cannot be graded (no task, or a reward basis this grader does not
    compute): a configuration problem, not a score."""


@lru_cache(maxsize=256)
def _gold_changes(calls_json: str, directory: Path) -> Changes:
    # Keyed by the calls themselves, so a task's gold database is computed once per data directory
    # whether the row carries its actions or only its task id. Cached values are shared: read them only.
    calls: list[ToolCall] = [(name, arguments) for name, arguments in json.loads(calls_json)]
    return replay(calls, base=database(directory)).changes


def gold_changes(calls: Sequence[ToolCall], directory: Path) -> Changes:
    """The records a correct agent changes: the gold calls applied to a fresh copy of the airline (a gold
    call that fails changes nothing, as τ²-bench's evaluator skips it)."""
    calls_json = json.dumps([[name, arguments] for name, arguments in calls], sort_keys=True)
    return _gold_changes(calls_json, directory)


def database_differences(actual: RolloutState, expected: RolloutState) -> list[str]:
    """`collection/key` of every record that differs, compared as τ²-bench compares databases (the JSON
    of every record, keys sorted; only the records either side changed can differ)."""
    return differing_records(actual, expected, COLLECTIONS, canonical_record)


def expectations(item: Mapping[str, Any], directory: Path) -> tuple[list[ToolCall], list[str], list[str]]:
    """The gold calls, the facts to communicate and the reward basis of a dataset row: its own fields,
    else its task's."""
    task = row_task(item, lambda task_id: get_task(directory, task_id))
    calls, communicate = row_expectations(item, task, "airline", AirlineItemError)
    return calls, communicate, _reward_basis(item, task)


def _reward_basis(item: Mapping[str, Any], task: AirlineTask | None) -> list[str]:
    basis = item.get("reward_basis")
    if not (isinstance(basis, list) and all(isinstance(entry, str) for entry in basis)):
        basis = (
            list(task.evaluation_criteria.reward_basis) if task is not None else list(DEFAULT_REWARD_BASIS)
        )
    unsupported = sorted(set(basis) - SUPPORTED_BASES)
    if unsupported:
        raise AirlineItemError(
            f"the airline grader computes the reward bases {', '.join(sorted(SUPPORTED_BASES))}; "
            f"the row asks for {', '.join(unsupported)}"
        )
    return basis


@pack.state_check("airline")
def check_rollout(view: RolloutView) -> CheckResult:
    """τ²-bench's reward: the product of the parts in the task's reward basis. db: the final database
    equals the gold one; communicate: every required fact is in the final answer."""
    directory = view.resource(AirlineData).directory
    calls, communicate_info, basis = expectations(view.item, directory)
    gold = RolloutState(database(directory), gold_changes(calls, directory), writable=False)
    db = 0.0 if database_differences(view.state, gold) else 1.0
    communicate = 1.0 if all(told(info, view) for info in communicate_info) else 0.0
    score = 1.0
    sub_scores: dict[str, float] = {}
    if ENV_BASES & set(basis):
        sub_scores["db"] = db
        score *= db
    if "COMMUNICATE" in basis:
        sub_scores["communicate"] = communicate
        score *= communicate
    flags = []
    if not view.calls:
        # τ²-bench rewards a rollout that rightly changed nothing, with or without calls; the retail
        # grader scores one without calls 0. Here the score is τ²-bench's and the review sees the flag.
        flags.append((NO_TOOL_CALLS, "the rollout made no tool call: the customer was never looked up"))
    premature = premature_end(view)
    if premature is not None:
        score = 0.0
        flags.append(premature)
    return CheckResult(score=score, sub_scores=sub_scores, flags=flags)
