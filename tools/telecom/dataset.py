"""Agent RFT dataset lines for the telecom tasks (the base split), and the user scenario of a row."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sparring.usersim import SCENARIO_KEY
from tools.retail import dataset as retail_dataset
from tools.retail.data import read_user_guidelines
from tools.retail.dataset import write_lines
from tools.retail.tasks import named_task
from tools.telecom import data
from tools.telecom.data import TelecomData
from tools.telecom.tasks import SPLITS, Split, TelecomTask, get_task, load_tasks, split_task_ids
from tools.telecom.tools import pack

# The customer's first message is the task's ticket. A telecom fix needs the customer's hands on their
# phone, so a rollout is meant to run with a simulated user: the row's `user_simulator` holds τ²'s
# scenario, guidelines (the variant for a user with tools) and the phone's tools the user calls.
PREFACE = """\
You are a customer service agent of a mobile carrier, working with the tools provided and following the \
policy below. The customer can act on their phone when you ask them to.

"""


def developer_message(policy: str) -> str:
    return PREFACE + policy


def user_simulator(task: TelecomTask, guidelines: str, guidelines_tools: str) -> dict[str, Any]:
    """What a simulated user of the task needs (sparring.usersim): τ²'s scenario, its guidelines (the
    `_tools` variant is the one it reads, since it has tools), and the phone's tools it calls at
    `/user-tools/<name>`."""
    return {
        "scenario": task.user_scenario.model_dump(mode="json"),
        "guidelines": guidelines,
        "guidelines_tools": guidelines_tools,
        "tools": [spec.function_tool() for spec in pack.user_tools.values()],
    }


def dataset_line(
    task: TelecomTask, policy: str, tools: list[dict[str, Any]], user: dict[str, Any]
) -> dict[str, Any]:
    """One RFT line: the two messages, the agent's tools, what the grader and the simulated user read
    (`user` is the task's `user_simulator`)."""
    criteria = task.evaluation_criteria
    return {
        "messages": [
            {"role": "developer", "content": developer_message(policy)},
            {
                "role": "user",
                "content": (task.ticket or task.user_scenario.instructions.reason_for_call).strip(),
            },
        ],
        "tools": tools,
        "task_id": task.id,
        "actions": [action.model_dump(exclude_none=True) for action in criteria.actions],
        "reward_basis": list(criteria.reward_basis),
        SCENARIO_KEY: user,
    }


def build_dataset(directory: Path, split: Split) -> list[dict[str, Any]]:
    """The lines of a split of the base task set (train: 74 tasks, test: 40), in τ²-bench's order."""
    tasks = load_tasks(directory)
    policy = data.read_policy(directory)
    tools = [spec.function_tool() for spec in pack.tools.values()]
    guidelines = read_user_guidelines(directory)
    guidelines_tools = read_user_guidelines(directory, tools=True)
    lines = []
    for task_id in split_task_ids(directory, split):
        task = tasks[task_id]
        lines.append(dataset_line(task, policy, tools, user_simulator(task, guidelines, guidelines_tools)))
    return lines


@pack.dataset
def build(resources: TelecomData, split: str, out: Path) -> int:
    """`sparring dataset build telecom --split train|test --out FILE`: write the split, then check it."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; the telecom splits are {', '.join(SPLITS)}")
    count = write_lines(build_dataset(resources.directory, split), out)
    problems = retail_dataset.check_dataset(out.read_text(encoding="utf-8").splitlines(), pack.tools)
    if problems:
        raise ValueError(f"{out} would fail a job: " + "; ".join(problems[:5]))
    return count


@pack.scenario
def scenario(resources: TelecomData, item: Mapping[str, Any]) -> dict[str, Any] | None:
    """A row's `user_simulator` (the task's scenario, τ²'s guidelines, the phone's tools), by its
    task_id, for a row that does not carry it; None for a row without a known task."""
    directory = resources.directory
    task = named_task(directory, item, get_task)
    if task is None:
        return None
    return user_simulator(task, read_user_guidelines(directory), read_user_guidelines(directory, tools=True))
