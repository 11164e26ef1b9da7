"""The `code` grader: the task's hidden tests against the rollout's final solution.py, in a fresh sandbox.

Score 1 when every hidden assert passes, else 0. The tests are looked up by the row's `task_id` (never
taken from the request), run by the harness (`harness_main.py`) in a sandbox of their own, and a pass is
the harness printing a token drawn for this run only; see `harness_main.py` for why exits, patched
builtins and objects that claim equality cannot print it.
"""

from __future__ import annotations

import json
import secrets
from functools import cache
from pathlib import Path

from app.sdk import CheckResult, RolloutView, ToolUnavailable
from tools.code.runtime import CodeResources
from tools.code.sandbox import WORKSPACE_ARG, Limits, RunResult, Sandbox, SandboxUnavailable
from tools.code.suspicious import TIMEOUT, code_flags
from tools.code.tasks import SOLUTION_FILE, CodeTask
from tools.code.tools import pack
from tools.code.workspace import Workspace, collection

# The hidden tests of one task get 20 seconds (wall clock and CPU) in a sandbox of their own.
GRADE_LIMITS = Limits(wall_seconds=20.0, cpu_seconds=20, output_bytes=8 * 1024)
NO_SOLUTION = "no_solution"


class CodeItemError(ValueError):
    """The row sent to the grader names no known task: a configuration problem, not a score."""


@cache
def _source(name: str) -> str:
    return (Path(__file__).parent / name).read_text(encoding="utf-8")


def final_files(view: RolloutView, task: CodeTask) -> dict[str, str]:
    """The rollout's final workspace for `task` (its edits made without a task id in the row included)."""
    files = Workspace(view.state, task).files()
    for path, content in view.state.items(collection(None)):
        files[path] = content
    return files


async def run_hidden_tests(
    sandbox: Sandbox, task: CodeTask, files: dict[str, str], *, owner: str | None = None
) -> tuple[bool, RunResult]:
    """Run the task's hidden tests against `files`; True only if the harness printed this run's token.

    ToolUnavailable when the sandbox cannot run: the grade is then unavailable, never a score of 0.
    """
    token = secrets.token_hex(16)
    job = {
        "prompt": task.prompt,
        "test": task.test,
        "entry_point": task.entry_point,
        "token": token,
        "runner": _source("harness_runner.py"),
    }
    try:
        result = await sandbox.run(
            files,
            ["-I", "-B", "-X", "utf8", "-c", _source("harness_main.py"), WORKSPACE_ARG],
            limits=GRADE_LIMITS,
            stdin=json.dumps(job).encode(),
            cwd="root",
            owner=owner,
        )
    except OSError as exc:
        raise ToolUnavailable(f"the sandbox could not start: {exc.strerror or exc}") from exc
    except SandboxUnavailable as exc:
        raise ToolUnavailable(f"the sandbox could not start: {exc}") from exc
    lines = result.stdout.data.decode("utf-8", "replace").splitlines()
    passed = result.exit_code == 0 and bool(lines) and lines[-1] == token
    return passed, result


@pack.state_check("code")
async def check_rollout(view: RolloutView) -> CheckResult:
    """hidden_tests: 1 when every hidden assert of the task passes against the final solution.py, else 0."""
    task_id = view.item.get("task_id")
    resources = view.resource(CodeResources)
    task = resources.tasks.get(task_id) if isinstance(task_id, str) else None
    if task is None:
        raise CodeItemError(
            f"the code grader needs the dataset row's `task_id` of a HumanEval task; got {task_id!r}"
        )
    files = final_files(view, task)
    flags = code_flags(files, task.starting_files())
    if SOLUTION_FILE not in files:
        return CheckResult(
            score=0.0,
            sub_scores={"hidden_tests": 0.0},
            flags=[*flags, (NO_SOLUTION, "the workspace has no solution.py")],
        )
    passed, result = await run_hidden_tests(resources.sandbox, task, files, owner=view.trace_id)
    if result.timed_out:
        flags.append(
            (TIMEOUT, f"the hidden tests did not finish within {GRADE_LIMITS.wall_seconds:g} seconds")
        )
    score = 1.0 if passed else 0.0
    return CheckResult(score=score, sub_scores={"hidden_tests": score}, flags=flags)
