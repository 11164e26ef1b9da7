"""The `retail` grader: the rollout's final database against the gold one, and what the customer was told."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from app.sdk import CheckResult, GradingConfigError, RolloutState, RolloutView
from app.sdk.state import Changes
from tools.retail.data import RetailData
from tools.retail.records import COLLECTIONS, canonical_record
from tools.retail.tasks import RetailTask, ToolCall, calls_from_actions, get_task, replay
from tools.retail.tools import database, pack

NO_TOOL_CALLS = "no_tool_calls"
PREMATURE_END = "premature_end"
PREMATURE_ENDS = frozenset({"max_steps", "too_many_errors"})
"""How a conversation with the simulated user ends before the user stopped it (the sample's `ended_by`):
τ²'s MAX_STEPS and TOO_MANY_ERRORS, which its evaluator rewards 0 ("Simulation terminated prematurely").
The user's stop tokens (###STOP###, ###TRANSFER###, ###OUT-OF-SCOPE###) are all its USER_STOP, graded."""

T = TypeVar("T")


class RetailItemError(GradingConfigError, ValueError):
    """The row sent to the grader does not say which task it is: a configuration problem, not a score."""


def premature_end(view: RolloutView) -> tuple[str, str] | None:
    """The flag of a conversation that ended prematurely, as the sample's `ended_by` says (the loop
    sets it for a conversation with a simulated user), or None: τ²-bench scores such a rollout 0."""
    ended = view.sample.get("ended_by")
    if ended not in PREMATURE_ENDS:
        return None
    return (
        PREMATURE_END,
        f"the conversation ended by {ended} before the customer stopped it: "
        "τ²-bench rewards it 0 (terminated prematurely)",
    )


def communicated(info: str, answer: str) -> bool:
    """τ²-bench's test: `info` appears in the answer, ignoring case and commas ('1,093.34' has '1093.34')."""
    return info.lower() in answer.lower().replace(",", "")


SEND_TO_USER = "send_message_to_user"  # the tool of tool-only loops (SPARRING_USER_TOOL)


def agent_texts(view: RolloutView) -> list[str]:
    """What the agent told the customer: its final answer, and the messages of its answered
    `send_message_to_user` calls (a tool-only loop holds its conversation through them)."""
    sent = [
        call.arguments.get("message")
        for call in view.calls
        if call.tool == SEND_TO_USER
        and call.outcome in ("ok", "replayed")
        and isinstance(call.arguments, dict)
    ]
    return [view.final_answer, *(text for text in sent if isinstance(text, str))]


def told(info: str, view: RolloutView) -> bool:
    """τ²-bench's test over every message of the agent: `info` is in one of them."""
    return any(communicated(info, text) for text in agent_texts(view))


@lru_cache(maxsize=512)
def _gold_changes(calls_json: str, directory: Path) -> Changes:
    # Keyed by the calls themselves, so a task's gold database is computed once per data directory
    # whether the row carries its actions or only its task id. Cached values are shared: read them only.
    calls: list[ToolCall] = [(name, arguments) for name, arguments in json.loads(calls_json)]
    return replay(calls, base=database(directory)).changes


def gold_changes(calls: Sequence[ToolCall], directory: Path) -> Changes:
    """The records a correct agent changes: the gold calls applied to a fresh copy of the store."""
    calls_json = json.dumps([[name, arguments] for name, arguments in calls], sort_keys=True)
    return _gold_changes(calls_json, directory)


def database_differences(actual: RolloutState, expected: RolloutState) -> list[str]:
    """`collection/key` of every record that differs, compared as τ²-bench compares databases."""
    return differing_records(actual, expected, COLLECTIONS, canonical_record)


def differing_records(
    actual: RolloutState,
    expected: RolloutState,
    collections: Sequence[str],
    canonical: Callable[[str, Mapping[str, Any]], Mapping[str, Any]],
) -> list[str]:
    """`collection/key` of every record that differs between two states over one base.

    The reference hashes `json.dumps(db.model_dump(), sort_keys=True, default=str)`; comparing that text
    record by record (each record in its `canonical` dump) is the same test. Both states share the
    pack's base, so only the records either of them changed can differ: a grade reads a few records.
    """
    differences = []
    for collection in collections:
        for key in sorted(actual.changed(collection) | expected.changed(collection)):
            record, reference = actual.get(collection, key), expected.get(collection, key)
            if record is None or reference is None:
                if record is not reference:
                    differences.append(f"{collection}/{key}")
            elif _text(canonical(collection, record)) != _text(canonical(collection, reference)):
                differences.append(f"{collection}/{key}")
    return differences


def _text(record: Mapping[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, default=str)


def expectations(item: Mapping[str, Any], directory: Path) -> tuple[list[ToolCall], list[str]]:
    """The gold calls and the facts to communicate for a dataset row: its own fields, else its task's."""
    return row_expectations(item, row_task(item, lambda task_id: get_task(directory, task_id)), "retail")


def row_task(item: Mapping[str, Any], lookup: Callable[[str], T]) -> T | None:
    """The task a row's `task_id` names (`lookup` raises KeyError for an unknown id), or None."""
    task_id = item.get("task_id")
    if not isinstance(task_id, (str, int)) or isinstance(task_id, bool):
        return None
    try:
        return lookup(str(task_id))
    except KeyError:
        return None


def row_expectations(
    item: Mapping[str, Any],
    task: RetailTask | None,
    grader: str,
    error: type[RetailItemError] = RetailItemError,
) -> tuple[list[ToolCall], list[str]]:
    """A τ²-bench row's gold calls and facts to communicate: its own `actions` and `communicate_info`,
    else its task's. `error` (the grader's own RetailItemError) when it has neither actions nor a task."""
    actions = item.get("actions")
    if isinstance(actions, list):
        try:
            calls = calls_from_actions(actions)
        except ValidationError as exc:
            raise error(f"item.actions is not a list of {{name, arguments}} objects: {exc}") from exc
    elif task is not None:
        calls = [(a.name, dict(a.arguments)) for a in task.evaluation_criteria.actions]
    else:
        raise error(
            f"the {grader} grader needs the dataset row's `actions` or a known `task_id`; "
            f"the item it received has neither (task_id={item.get('task_id')!r})"
        )
    info = item.get("communicate_info")
    if isinstance(info, list) and all(isinstance(entry, str) for entry in info):
        communicate = list(info)
    elif task is not None:
        communicate = list(task.evaluation_criteria.communicate_info)
    else:
        communicate = []
    return calls, communicate


@pack.state_check("retail")
def check_rollout(view: RolloutView) -> CheckResult:
    """db: the final database equals the gold one; communicate: every required fact is in the final answer."""
    directory = view.resource(RetailData).directory
    calls, communicate_info = expectations(view.item, directory)
    gold = RolloutState(database(directory), gold_changes(calls, directory), writable=False)
    db = 0.0 if database_differences(view.state, gold) else 1.0
    communicate = 1.0 if all(told(info, view) for info in communicate_info) else 0.0
    sub_scores = {"db": db, "communicate": communicate}
    score = db * communicate
    flags: list[tuple[str, str]] = []
    if not view.calls:
        # Even when nothing had to change, an agent that never looked the customer up did not do the job.
        score = 0.0
        flags.append((NO_TOOL_CALLS, "the rollout made no tool call: the customer was never authenticated"))
    premature = premature_end(view)
    if premature is not None:
        score = 0.0
        flags.append(premature)
    return CheckResult(score=score, sub_scores=sub_scores, flags=flags)
