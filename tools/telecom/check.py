"""The `telecom` grader: τ²-bench's reward for the task's basis — its env assertions on the rollout's final
carrier records and phone, times the gold actions' match where the basis has ACTION."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from app.sdk import CallView, CheckResult, RolloutState, RolloutView, ToolError
from tools.retail.check import RetailItemError, premature_end
from tools.telecom.data import TelecomData
from tools.telecom.records import SETUP, TASK
from tools.telecom.rollout import Rollout, run_function, set_up
from tools.telecom.tasks import EnvAssertion, TelecomAction, TelecomTask, get_task
from tools.telecom.tools import pack

SUPPORTED_BASES = frozenset({"ENV_ASSERTION", "ACTION"})
NO_TOOL_CALLS = "no_tool_calls"


class TelecomItemError(RetailItemError):
    """The row sent to the grader cannot be graded (no task, or a reward basis this grader does not
    compute): a configuration problem, not a score."""


def row_telecom_task(item: Mapping[str, Any], directory: Path) -> TelecomTask:
    task_id = item.get("task_id")
    if not isinstance(task_id, str):
        raise TelecomItemError(
            "the telecom grader needs the row's task_id (a dataset line of `telecom` has it)"
        )
    try:
        task = get_task(directory, task_id)
    except KeyError as exc:
        raise TelecomItemError(f"no telecom task with id {task_id!r}") from exc
    unsupported = sorted(set(task.evaluation_criteria.reward_basis) - SUPPORTED_BASES)
    if unsupported:
        raise TelecomItemError(
            f"the telecom grader computes ENV_ASSERTION and ACTION; the task asks for {unsupported}"
        )
    return task


def assertions_met(
    state: RolloutState, item: Mapping[str, Any], assertions: Sequence[EnvAssertion], directory: Path
) -> list[bool]:
    """Each assertion on the final state (a writable copy: τ²-bench syncs after each), the task's
    initialization applied first when the rollout never made a call that did it."""
    rollout = Rollout.open(RolloutState(state.snapshot(), {}, writable=True))
    if state.get(SETUP, TASK) is None:
        set_up(rollout, item, directory)
    met = []
    for assertion in assertions:
        try:
            result = run_function(rollout, assertion.env_type, assertion.func_name, assertion.arguments)
        except ToolError:
            result = None
        met.append(isinstance(result, bool) and result == assertion.assert_value)
    return met


def _arguments(call: CallView) -> dict[str, Any]:
    arguments = call.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def action_matched(action: TelecomAction, calls: Sequence[CallView]) -> bool:
    """τ²-bench's action check: some call of either side has the action's name and its arguments (those
    in `compare_args`, or all the call's arguments)."""
    for call in calls:
        if call.tool != action.name:
            continue
        arguments = _arguments(call)
        keys = list(arguments) if action.compare_args is None else action.compare_args
        if not keys:
            return True
        if {k: v for k, v in arguments.items() if k in keys} == {
            k: v for k, v in action.arguments.items() if k in keys
        }:
            return True
    return False


@pack.state_check("telecom")
def check_rollout(view: RolloutView) -> CheckResult:
    """τ²-bench's reward on the task's reward basis: env assertions (and the gold actions for ACTION)."""
    directory = view.resource(TelecomData).directory
    task = row_telecom_task(view.item, directory)
    criteria = task.evaluation_criteria
    score = 1.0
    sub_scores: dict[str, float] = {}
    if "ENV_ASSERTION" in criteria.reward_basis:
        met = assertions_met(view.state, view.item, criteria.env_assertions, directory)
        sub_scores["env_assertion"] = 1.0 if all(met) else 0.0
        score *= sub_scores["env_assertion"]
    if "ACTION" in criteria.reward_basis:
        answered = list(view.calls)  # τ²-bench counts every call made, answered with an error or not
        sub_scores["action"] = 1.0 if all(action_matched(a, answered) for a in criteria.actions) else 0.0
        score *= sub_scores["action"]
    flags = []
    if not view.calls:
        flags.append((NO_TOOL_CALLS, "the rollout made no tool call"))
    premature = premature_end(view)
    if premature is not None:
        score = 0.0
        flags.append(premature)
    return CheckResult(score=score, sub_scores=sub_scores, flags=flags)
