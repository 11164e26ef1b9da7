"""Agent RFT dataset lines for the HumanEval tasks (train: 123 tasks, test: 41)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tools.code.runtime import RUN_LIMITS, CodeResources
from tools.code.tasks import EXAMPLES_FILE, SOLUTION_FILE, SPLITS, CodeTask, Split, split_task_ids
from tools.code.tools import pack
from tools.code.workspace import LIMITS

DEVELOPER_MESSAGE = f"""\
You are a careful Python programmer working in a small workspace of files, with tools to use it:

- list_files: the files of the workspace and their sizes;
- read_file(path): a file's content;
- write_file(path, content): create or replace a file (its whole content);
- run_python(path, args): run a Python file of the workspace (`python path args...`) and see its exit \
code, stdout, stderr and wall time;
- run_examples(): run {EXAMPLES_FILE}, the docstring's examples as asserts, against {SOLUTION_FILE};
- python(code): run code in your own persistent interpreter, like a notebook cell, in the workspace \
directory: variables, imports and files persist between calls; it answers stdout, stderr, the value of a \
final expression and the traceback of an exception.

The workspace starts with {SOLUTION_FILE}, which holds the function to implement (its signature and \
docstring), and {EXAMPLES_FILE}. Paths are relative to the workspace. Code runs with Python's standard \
library only, without network, for at most {RUN_LIMITS.wall_seconds:g} seconds a run; the workspace holds \
at most {LIMITS.max_files} files of at most {LIMITS.max_file_bytes // 1024} KiB each.

Your solution is the final content of {SOLUTION_FILE}: it is graded by hidden tests of the function, \
not by the examples, so make it correct for every input the docstring allows. Test it as you see fit, \
then answer with a short summary of what you did."""


def user_message(task: CodeTask) -> str:
    return (
        f"Implement `{task.entry_point}` in {SOLUTION_FILE}. The file currently holds:\n\n"
        f"```python\n{task.prompt.strip()}\n```"
    )


def dataset_line(task: CodeTask, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """One RFT line: messages, tools, the task id and the gold calls (for canaries, never the model)."""
    return {
        "messages": [
            {"role": "developer", "content": DEVELOPER_MESSAGE},
            {"role": "user", "content": user_message(task)},
        ],
        "tools": tools,
        "task_id": task.task_id,
        "actions": task.gold_actions(),
    }


def build_dataset(tasks: Mapping[str, CodeTask], split: Split) -> list[dict[str, Any]]:
    tools = [spec.function_tool() for spec in pack.tools.values()]
    return [dataset_line(tasks[task_id], tools) for task_id in split_task_ids(tasks, split)]


@pack.dataset
def build(resources: CodeResources, split: str, out: Path) -> int:
    """`sparring dataset build code --split train|test --out FILE`."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; the code splits are {', '.join(SPLITS)}")
    lines = build_dataset(resources.tasks, split)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for line in lines:
            handle.write(json.dumps(line, ensure_ascii=False) + "\n")
    return len(lines)
