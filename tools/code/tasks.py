"""The HumanEval tasks: prompts, hidden tests, the fixed split, each task's starting files and gold calls."""

from __future__ import annotations

import ast
import doctest
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from tools.code import data

Split = Literal["train", "test"]
SPLITS: tuple[Split, ...] = ("train", "test")
# The split is fixed and documented: every task whose number is a multiple of 4 is a test task
# (HumanEval/0, /4, ..., /160: 41 tasks), the other 123 are training tasks.
TEST_EVERY = 4

SOLUTION_FILE = "solution.py"
EXAMPLES_FILE = "examples.py"


@dataclass(frozen=True)
class CodeTask:
    """One HumanEval problem. `test` and `canonical_solution` are never shown to the model."""

    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str

    @property
    def number(self) -> int:
        return int(self.task_id.rsplit("/", 1)[-1])

    @property
    def split(self) -> Split:
        return "test" if self.number % TEST_EVERY == 0 else "train"

    @property
    def gold_solution(self) -> str:
        """The prompt completed with the canonical body: the file a correct agent leaves behind."""
        return self.prompt + self.canonical_solution

    def starting_files(self) -> dict[str, str]:
        """The workspace a rollout starts from: the stub to complete and the docstring's examples."""
        return starting_files(self)

    def gold_actions(self) -> list[dict[str, Any]]:
        """The calls a correct agent could make, as `{name, arguments}` objects (the dataset's `actions`)."""
        return [{"name": "write_file", "arguments": {"path": SOLUTION_FILE, "content": self.gold_solution}}]


@lru_cache(maxsize=2)
def load_tasks(directory: Path) -> Mapping[str, CodeTask]:
    """Every task in the data `directory` by id, in HumanEval's order (read once per directory)."""
    tasks = {}
    for problem in data.read_problems(directory):
        task = CodeTask(
            task_id=str(problem["task_id"]),
            prompt=str(problem["prompt"]),
            entry_point=str(problem["entry_point"]),
            canonical_solution=str(problem["canonical_solution"]),
            test=str(problem["test"]),
        )
        tasks[task.task_id] = task
    return tasks


def split_task_ids(tasks: Mapping[str, CodeTask], split: Split) -> list[str]:
    return [task.task_id for task in tasks.values() if task.split == split]


@lru_cache(maxsize=256)
def starting_files(task: CodeTask) -> dict[str, str]:
    return {SOLUTION_FILE: task.prompt, EXAMPLES_FILE: examples_file(task)}


# --- the docstring's examples as asserts --------------------------------------------------------------

# Examples written as prose: `f(x) == y`, `f(x) ==> y`, `f(x) -> y`, `f(x) ➞ y`, `f(x) returns y`, ...
_ARROWS = re.compile(r"^\s*(?:==>|=>|==|->|➞|=|should\s+return|returns?|is)\s*(.*)$")
# Examples whose docstring disagrees with HumanEval's canonical solution (and its hidden tests): left out
# so that examples.py never fails for a correct solution. Keyed by task id, then the call as written.
WRONG_EXAMPLES: Mapping[str, frozenset[str]] = {
    "HumanEval/47": frozenset({"median([-10, 4, 6, 1000, 10, 20])"}),  # the median is 8.0, not 15.0
    "HumanEval/130": frozenset({"tri(1)", "tri(2)", "tri(4)"}),  # the recurrence; tri(n) returns a list
    "HumanEval/148": frozenset({'bf("Earth", "Mercury")'}),  # ("Venus") is a string, not a 1-tuple
}


@dataclass(frozen=True)
class Example:
    call: str  # a Python expression calling the entry point
    expected: str  # a Python expression of the expected value


def _expression(text: str) -> str | None:
    text = text.strip().rstrip(",.;").strip()
    if not text:
        return None
    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    return text


def _is_literal(source: str) -> bool:
    try:
        ast.literal_eval(source)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return True


def _literal_call(source: str, entry_point: str) -> bool:
    """True for `entry_point(<literals>)`: a call whose arguments are plain values."""
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        return False
    call = tree.body
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == entry_point
        and all(_is_literal(ast.unparse(arg)) for arg in call.args)
        and all(
            keyword.arg is not None and _is_literal(ast.unparse(keyword.value)) for keyword in call.keywords
        )
    )


def _prose_example(line: str, entry_point: str) -> Example | None:
    start = line.find(entry_point + "(")
    if start < 0:
        return None
    text = line[start:]
    # The shortest prefix that parses as a call is the call; what follows it is the expected value.
    for end in range(len(entry_point) + 2, len(text) + 1):
        if text[end - 1] != ")":
            continue
        call = text[:end]
        if _expression(call) is None:
            continue
        match = _ARROWS.match(text[end:])
        if match is None:
            return None
        rest = match.group(1)
        expected = _expression(rest)
        if expected is None and "=" in rest:  # "19 - 5 - 6 = 8": the value after the last '='
            expected = _expression(rest.rsplit("=", 1)[1])
        return Example(call, expected) if expected is not None else None
    return None


def docstring_examples(task: CodeTask) -> list[Example]:
    """The examples of the entry point's docstring that read as `call -> value`, in order."""
    examples: list[Example] = []
    docstring = _docstring(task)
    try:
        parsed = doctest.DocTestParser().get_examples(docstring)
    except ValueError:  # a docstring doctest cannot read (inconsistent indentation): read it as prose
        parsed = []
    if parsed:
        for example in parsed:
            call = _expression(example.source)
            expected = _expression(example.want)
            if call and expected:
                examples.append(Example(call, expected))
    else:
        for line in docstring.splitlines():
            found = _prose_example(line, task.entry_point)
            if found is not None:
                examples.append(found)
    wrong = WRONG_EXAMPLES.get(task.task_id, frozenset())
    return [
        example
        for example in examples
        if example.call not in wrong
        and _literal_call(example.call, task.entry_point)
        and _is_literal(example.expected)
    ]


def _docstring(task: CodeTask) -> str:
    try:
        tree = ast.parse(task.prompt)
    except SyntaxError:
        return ""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == task.entry_point:
            return ast.get_docstring(node) or ""
    return ""


def examples_file(task: CodeTask) -> str:
    """`examples.py`: the docstring's examples as asserts against `solution.py`, one message per failure."""
    examples = docstring_examples(task)
    lines = [
        f'"""The examples from the docstring of {task.entry_point}, as asserts. Run: python examples.py"""',
        "",
        f"from solution import {task.entry_point}",
        "",
    ]
    for example in examples:
        lines += [
            f"result = {example.call}",
            f"assert result == {example.expected}, {example.call + ' returned '!r} + repr(result)"
            f" + {', expected ' + example.expected!r}",
        ]
    lines += ["", f"print({f'all {len(examples)} examples passed'!r})", ""]
    return "\n".join(lines)
