"""Agent RFT dataset lines for the retail tasks, and the checks every line must pass before a job uses it."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from sparring.usersim import SCENARIO_KEY
from tools.retail import data
from tools.retail.data import RetailData
from tools.retail.tasks import SPLITS, RetailTask, Split, get_task, load_tasks, named_task, split_task_ids
from tools.retail.tools import pack

# A training rollout has no user simulator: the model sees one customer message and acts on it.
# The preface tells it so, because the shipped policy asks for explicit confirmation before every
# write and would otherwise leave the model waiting for a "yes" that never comes.
PREFACE = """\
You are a customer service agent of an online retail store, working with the tools provided and \
following the policy below.

In this conversation the customer writes exactly once and cannot reply: their message is complete. \
Where the policy asks you to obtain the user's explicit confirmation before an action, their message \
counts as that confirmation for the actions it requests, so act on it without waiting for a reply. \
Everything else in the policy applies as written: authenticate the customer first, check order \
statuses, and refuse what the policy does not allow. When you are done, write your final message to \
the customer: what you did and everything they asked to know (amounts, ids, product details).

"""

# With a simulated user (`sparring eval --user-model`, sparring.usersim) the agent holds a conversation:
# this prompt replaces the preface, since the customer now answers, confirms and ends the conversation.
CONVERSATION_PREFACE = """\
You are a customer service agent. Help the customer following the policy below, with the tools provided. \
Each of your turns either writes one message to the customer or makes tool calls, never both. Follow \
the policy as written, including getting the customer's explicit confirmation before any action that \
changes their account.

"""

# Some scenarios carry only a placeholder ('.') where the customer's manner would be described.
_PLACEHOLDERS = {"", "."}


def developer_message(policy: str) -> str:
    return PREFACE + policy


def user_message(task: RetailTask) -> str:
    """The customer's one message, written from the task's scenario: who they are, what they know and want.

    τ²-bench writes scenarios as instructions to a simulated customer ("You are Yusuf Rossi..."). They
    are kept word for word, framed as the customer's own notes: rewording them could change what a
    correct agent must do, and the gold actions depend on every detail.
    """
    scenario = task.user_scenario
    instructions = scenario.instructions
    sections = [
        "Hi, I need help from customer service. I can't stay to chat, so I've put everything into this one "
        'message, written as notes to myself ("you" means me, the customer). Please take it as complete, '
        "and as my confirmation to go ahead with what I ask for."
    ]
    about = [text for text in (scenario.persona, instructions.known_info) if _given(text)]
    if about:
        sections.append("Who I am:\n" + "\n".join(str(text).strip() for text in about))
    if _given(instructions.unknown_info):
        sections.append(f"What I don't know:\n{str(instructions.unknown_info).strip()}")
    sections.append(f"What I want:\n{instructions.reason_for_call.strip()}")
    if _given(instructions.task_instructions):
        sections.append(f"Other notes:\n{str(instructions.task_instructions).strip()}")
    return "\n\n".join(sections)


def _given(text: str | None) -> bool:
    return text is not None and text.strip() not in _PLACEHOLDERS


def user_simulator(task: RetailTask, policy: str, guidelines: str) -> dict[str, Any]:
    """What a simulated user of the task needs (sparring.usersim): τ²'s scenario and guidelines, and
    the agent's opening message when it talks to that user instead of reading one complete message."""
    return {
        "scenario": task.user_scenario.model_dump(mode="json"),
        "guidelines": guidelines,
        "agent_messages": [{"role": "developer", "content": CONVERSATION_PREFACE + policy}],
    }


def dataset_line(
    task: RetailTask, policy: str, tools: list[dict[str, Any]], guidelines: str
) -> dict[str, Any]:
    """One RFT line: the two messages, the served tools' schemas, what the `retail` grader reads, and
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
        SCENARIO_KEY: user_simulator(task, policy, guidelines),
    }


def build_dataset(directory: Path, split: Split) -> list[dict[str, Any]]:
    """The lines of a split (train: 74 tasks, test: 40), in τ²-bench's split order."""
    tasks = load_tasks(directory)
    policy = data.read_policy(directory)
    guidelines = data.read_user_guidelines(directory)
    tools = [spec.function_tool() for spec in pack.tools.values()]
    return [
        dataset_line(tasks[task_id], policy, tools, guidelines)
        for task_id in split_task_ids(directory, split)
    ]


def write_dataset(directory: Path, split: Split, out: Path) -> int:
    """Write a split as JSONL to `out` and return the number of lines written."""
    return write_lines(build_dataset(directory, split), out)


def write_lines(lines: list[dict[str, Any]], out: Path) -> int:
    """Write dataset lines as JSONL to `out` (non-ASCII kept as is) and return how many."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for line in lines:
            handle.write(json.dumps(line, ensure_ascii=False) + "\n")
    return len(lines)


def check_dataset(lines: Iterable[str], served_tool_names: Collection[str]) -> list[str]:
    """Problems that would make a training job fail or a rollout unfixable, one message per problem.

    Each line must be a JSON object whose `messages` end with a user message and whose `tools` are
    function tools served under the same names.
    """
    problems: list[str] = []
    count = 0
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        count += 1
        try:
            line = json.loads(text)
        except ValueError as exc:
            problems.append(f"line {number}: not valid JSON ({exc})")
            continue
        if not isinstance(line, dict):
            problems.append(f"line {number}: not a JSON object")
            continue
        problems.extend(f"line {number}: {problem}" for problem in _line_problems(line, served_tool_names))
    if count == 0:
        problems.append("the dataset has no lines")
    return problems


def _line_problems(line: dict[str, Any], served: Collection[str]) -> list[str]:
    problems = []
    messages = line.get("messages")
    if not isinstance(messages, list) or not messages:
        problems.append("`messages` must be a non-empty list")
    else:
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                problems.append(f"messages[{index}] must be an object with a `role`")
        last = messages[-1]
        if isinstance(last, dict) and last.get("role") != "user":
            problems.append(f"the last message must be from the user, not {last.get('role')!r}")
    tools = line.get("tools")
    if tools is None:
        return problems
    if not isinstance(tools, list):
        return [*problems, "`tools` must be a list"]
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            problems.append(f"tools[{index}] is not a function tool with a name")
        elif name not in served:
            problems.append(f"tools[{index}] names {name!r}, which the server does not serve")
    return problems


@pack.dataset
def build(resources: RetailData, split: str, out: Path) -> int:
    """`sparring dataset build retail --split train|test --out FILE`: write the split, then check it."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; the retail splits are {', '.join(SPLITS)}")
    count = write_dataset(resources.directory, split, out)
    problems = check_dataset(out.read_text(encoding="utf-8").splitlines(), pack.tools)
    if problems:
        raise ValueError(f"{out} would fail a job: " + "; ".join(problems[:5]))
    return count


@pack.scenario
def scenario(resources: RetailData, item: Mapping[str, Any]) -> dict[str, Any] | None:
    """A row's `user_simulator` (the task's scenario and τ²'s guidelines), by its task_id, for a row
    that does not carry it; None for a row without a known task."""
    directory = resources.directory
    task = named_task(directory, item, get_task)
    if task is None:
        return None
    return user_simulator(task, data.read_policy(directory), data.read_user_guidelines(directory))
