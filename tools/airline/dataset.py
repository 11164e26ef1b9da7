"""Agent RFT dataset lines for the airline tasks (checked as the retail lines are)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparring.usersim import SCENARIO_KEY
from tools.airline import data
from tools.airline.data import AirlineData
from tools.airline.tasks import SPLITS, AirlineTask, Split, get_task, load_tasks, split_task_ids
from tools.airline.tools import pack
from tools.retail import dataset as retail_dataset
from tools.retail.data import read_user_guidelines
from tools.retail.dataset import user_message, user_simulator, write_lines
from tools.retail.tasks import named_task

# A training rollout without a simulated user sees one customer message and acts on it: the preface
# says so, as the retail one does, because the policy asks for explicit confirmation before every write.
PREFACE = """\
You are a customer service agent of an airline, working with the tools provided and following the \
policy below.

In this conversation the customer writes exactly once and cannot reply: their message is complete. \
Where the policy asks you to obtain the user's explicit confirmation before an action, their message \
counts as that confirmation for the actions it requests, so act on it without waiting for a reply. \
Everything else in the policy applies as written: authenticate the customer first, check the \
reservation and its flights, and refuse what the policy does not allow. When you are done, write your \
final message to the customer: what you did and everything they asked to know (amounts, ids, flights).

"""


def developer_message(policy: str) -> str:
    return PREFACE + policy


def dataset_line(
    task: AirlineTask, policy: str, tools: list[dict[str, Any]], guidelines: str
) -> dict[str, Any]:
    """One RFT line: the two messages, the served tools' schemas, what the `airline` grader reads, and
    what a simulated user needs."""
    criteria = task.evaluation_criteria
    return {
        "messages": [
            {"role": "developer", "content": developer_message(policy)},
            {"role": "user", "content": user_message(task)},
        ],
        "tools": tools,
        "task_id": task.id,
        "actions": [action.model_dump(exclude_none=True) for action in criteria.actions],
        "communicate_info": list(criteria.communicate_info),
        "reward_basis": list(criteria.reward_basis),
        SCENARIO_KEY: user_simulator(task, policy, guidelines),
    }


def build_dataset(directory: Path, split: Split) -> list[dict[str, Any]]:
    """The lines of a split (train: 30 tasks, test: 20), in τ²-bench's split order."""
    tasks = load_tasks(directory)
    policy = data.read_policy(directory)
    guidelines = read_user_guidelines(directory)
    tools = [spec.function_tool() for spec in pack.tools.values()]
    return [
        dataset_line(tasks[task_id], policy, tools, guidelines)
        for task_id in split_task_ids(directory, split)
    ]


def write_dataset(directory: Path, split: Split, out: Path) -> int:
    """Write a split as JSONL to `out` and return the number of lines written."""
    return write_lines(build_dataset(directory, split), out)


@pack.dataset
def build(resources: AirlineData, split: str, out: Path) -> int:
    """`sparring dataset build airline --split train|test --out FILE`: write the split, then check it."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; the airline splits are {', '.join(SPLITS)}")
    count = write_dataset(resources.directory, split, out)
    problems = retail_dataset.check_dataset(out.read_text(encoding="utf-8").splitlines(), pack.tools)
    if problems:
        raise ValueError(f"{out} would fail a job: " + "; ".join(problems[:5]))
    return count


@pack.scenario
def scenario(resources: AirlineData, item: Mapping[str, Any]) -> dict[str, Any] | None:
    """A row's `user_simulator` (the task's scenario and τ²'s guidelines), by its task_id, for a row
    that does not carry it; None for a row without a known task."""
    directory = resources.directory
    task = named_task(directory, item, get_task)
    if task is None:
        return None
    return user_simulator(task, data.read_policy(directory), read_user_guidelines(directory))
