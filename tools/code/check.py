"""The `code` grader: the task's hidden tests against the rollout's final box.

Score 1 when every hidden assert passes, else 0. The tests are the HumanEval task's of the row's
`task_id` (never taken from the request); a row without a HumanEval task may carry its own (`tests`).
Where they run is the row's `check_in`:

- `"workspace"` (the default): against the rollout's final workspace (its files as the rollout's state
  keeps them), copied into a fresh sandbox of its own that is never read back. The harness
  (`harness_main.py`) runs them, and a pass is the harness printing a token drawn for this run only; see
  `harness_main.py` for why exits, patched builtins and objects that claim equality cannot print it.
- `"interpreter"`: in the rollout's live `python` interpreter, in a fork of it (`Interpreter.check`):
  the tests see the variables, functions and imports the agent's cells left; the interpreter's own
  namespace is untouched and its workspace is put back afterwards. A rollout whose interpreter is gone
  is refused (`StateGone`: 409), never scored 0.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from app.sdk import CheckResult, GradingConfigError, RolloutView, StateGone, ToolUnavailable
from tools.code.interpreter import (
    MARKER,
    Interpreter,
    InterpreterGone,
    InterpreterStopped,
    JudgeFailed,
    StoppedByItsCode,
)
from tools.code.runtime import CodeResources
from tools.code.sandbox import WORKSPACE_ARG, Limits, RunResult, Sandbox, SandboxUnavailable
from tools.code.suspicious import TIMEOUT, code_flags
from tools.code.tasks import SOLUTION_FILE, CodeTask
from tools.code.tools import pack
from tools.code.workspace import Workspace, collection

# The hidden tests of one task get 20 seconds (wall clock and CPU) in a sandbox of their own.
GRADE_LIMITS = Limits(wall_seconds=20.0, cpu_seconds=20, output_bytes=8 * 1024)
NO_SOLUTION = "no_solution"
NO_INTERPRETER = "no_interpreter"
INTERPRETER_STOPPED = "interpreter_stopped"
FILES_NOT_PLACED = "final_files_not_placed"
# The row's tests name no entry point: they ran in the rollout's own interpreter process, whose code can
# change what they find (nothing outside that process can run them against its state).
CHECK_IN_AGENT_PROCESS = "check_in_agent_process"
CHECK_IN = ("workspace", "interpreter")  # where a row's `check_in` asks the hidden tests to run
MAX_TEST_CHARS = 256 * 1024


class CodeItemError(GradingConfigError, ValueError):
    """The row sent to the grader names no known task and has no tests of its own: a configuration
    problem (422), not a score."""


@cache
def _source(name: str) -> str:
    return (Path(__file__).parent / name).read_text(encoding="utf-8")


def final_files(view: RolloutView, task: CodeTask | None) -> dict[str, str]:
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
    if lines and lines[-1] == f"{token} cpu-time-limit":
        # The solution's process was ended by its CPU-time limit before the wall clock ran out.
        result = dataclasses.replace(result, timed_out=True)
    return passed, result


def row_task(item: Mapping[str, Any]) -> CodeTask:
    """The row's own tests (`tests`: `entry_point`, `test`, optional `prompt`) as a task; a malformed
    one is a configuration error (422), never a score."""
    tests = item.get("tests")
    if not isinstance(tests, dict):
        raise CodeItemError(
            "the code grader needs the dataset row's `task_id` of a HumanEval task, or the row's own "
            f"`tests`; got task_id {item.get('task_id')!r}"
        )
    entry_point, test, prompt = tests.get("entry_point", ""), tests.get("test"), tests.get("prompt", "")
    if not isinstance(test, str) or not test.strip() or len(test) > MAX_TEST_CHARS:
        raise GradingConfigError(
            f"the row's tests.test must be Python source of 1 to {MAX_TEST_CHARS} characters"
        )
    if not isinstance(prompt, str) or len(prompt) > MAX_TEST_CHARS:
        raise GradingConfigError("the row's tests.prompt must be Python source (the helpers the tests use)")
    if not isinstance(entry_point, str) or (entry_point and not entry_point.isidentifier()):
        raise GradingConfigError("the row's tests.entry_point must be the name of the function to test")
    return CodeTask(
        task_id=str(item.get("task_id") or "row"),
        prompt=prompt,
        entry_point=entry_point,
        canonical_solution="",
        test=test,
    )


def check_place(item: Mapping[str, Any]) -> str:
    """The row's `check_in` ("workspace" when absent); another value is a configuration error."""
    place = item.get("check_in", "workspace")
    if place not in CHECK_IN:
        raise GradingConfigError(f"the row's check_in must be one of {', '.join(CHECK_IN)}; got {place!r}")
    return str(place)


async def run_in_interpreter(
    view: RolloutView, task: CodeTask, files: dict[str, str]
) -> tuple[bool | None, list[tuple[str, str]]]:
    """The task's tests in a fork of the rollout's live interpreter, its workspace holding the rollout's
    final `files`: (passed, flags); passed is None when the rollout never ran code in one (nothing to
    grade there), False with a flag when the rollout's own code stopped it. StateGone (a refused grade)
    when its interpreter is otherwise gone; ToolUnavailable when no slot or interpreter support is here."""
    resources = view.resource(CodeResources)
    pool = resources.interpreters
    marker = view.state.get(*MARKER)
    if marker is None or not view.trace_id:
        return None, [
            (NO_INTERPRETER, "the row is graded in the interpreter, but the rollout never ran code in it")
        ]
    if pool is None:
        raise StateGone("this server holds no interpreters, so the rollout's interpreter state is gone")
    job = {"test": task.test, "entry_point": task.entry_point, "prompt": task.prompt}
    flags = []
    interpreter: Interpreter | None = None
    try:
        async with pool.held(view.trace_id, marker) as interpreter:
            async with resources.sandbox.hold_slot(view.trace_id):
                # The rollout's final files, as its next cell would have them (written by other tools
                # since its last cell): placed for the grade, and the interpreter's put back after it.
                changes = interpreter.changes(files)
                if task.entry_point:
                    # The tests run in a judge no cell ran in; the entry point's calls in a fork of the
                    # rollout's interpreter, answering plain values only.
                    async with pool.judge() as judge:
                        verdict = await interpreter.judged(judge, job, GRADE_LIMITS.wall_seconds, changes)
                else:
                    verdict = await interpreter.check(job, GRADE_LIMITS.wall_seconds, changes)
                    flags.append(
                        (
                            CHECK_IN_AGENT_PROCESS,
                            "the row's tests name no entry_point, so they ran inside the rollout's own "
                            "interpreter process, where its code could change their verdict",
                        )
                    )
    except JudgeFailed as exc:
        raise ToolUnavailable(str(exc)) from exc
    except StoppedByItsCode as exc:
        # Its own last cell (or an earlier grade's check) stopped it: the rollout's doing, so a failed
        # check, never a refusal the trainer would retry and then throw away.
        return False, [(INTERPRETER_STOPPED, str(exc))]
    except InterpreterGone as exc:
        raise StateGone(f"the row is graded in the rollout's interpreter, but {exc}") from exc
    except InterpreterStopped as exc:
        # The rollout's code (or the check) stopped it while being checked: a failed check, and the state
        # is lost for any later call or grade, which says so.
        await pool.discard(
            view.trace_id, "it stopped while a grade's check ran in it", only=interpreter, by_its_code=True
        )
        return False, [(INTERPRETER_STOPPED, str(exc))]
    if verdict.timed_out:
        flags.append(
            (TIMEOUT, f"the hidden tests did not finish within {GRADE_LIMITS.wall_seconds:g} seconds")
        )
    if verdict.not_placed:
        listed = "; ".join(f"{path} ({why})" for path, why in verdict.not_placed[:5])
        flags.append(
            (
                FILES_NOT_PLACED,
                "files of the rollout's final workspace could not be placed in its interpreter's "
                f"workspace for the check, which saw the cells' versions of them: {listed}",
            )
        )
    return verdict.passed, flags


@pack.state_check("code")
async def check_rollout(view: RolloutView) -> CheckResult:
    """hidden_tests: 1 when every hidden assert of the task passes against the final box, else 0."""
    task_id = view.item.get("task_id")
    resources = view.resource(CodeResources)
    known = resources.tasks.get(task_id) if isinstance(task_id, str) else None
    task = known if known is not None else row_task(view.item)
    place = check_place(view.item)
    files = final_files(view, known)
    flags = code_flags(files, task.starting_files() if known is not None else None)
    if place == "interpreter":
        passed, more = await run_in_interpreter(view, task, files)
        score = 1.0 if passed else 0.0
        return CheckResult(score=score, sub_scores={"hidden_tests": score}, flags=[*flags, *more])
    if not task.entry_point:
        raise GradingConfigError("the row's tests.entry_point is needed to test the workspace's solution.py")
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
