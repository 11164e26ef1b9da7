"""The `code` grader on the agent's box: the final workspace and the live interpreter, over HTTP.

A solution that lives only in the workspace is graded from it; a check cannot change the agent's files
(in the workspace's copy, nor in the interpreter's box) or the interpreter's variables; a row graded in
the interpreter sees what the agent's cells defined; a rollout whose interpreter or state is gone is
refused (409), never scored 0; a hostile check stays in the sandbox.
"""

from __future__ import annotations

import asyncio
import json
import socket
import textwrap
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.code.conftest import CodeClient, all_tasks, served_resources
from tests.conftest import new_trace
from tests.grading.test_state_lost import forget_state
from tools.code.interpreter import RESTARTED, InterpreterPool, InterpreterStopped
from tools.code.runtime import CodeResources

# Redis: a rollout's state can expire under a live server, and two servers can share one store.
pytestmark = pytest.mark.parametrize("backend", ["real"])

FAST = {"interpreter_cell_seconds": 5.0}
ADD_TESTS = {
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
}
RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"


async def cell(code: CodeClient, trace: str, source: str, *, task_id: str | None = None) -> Any:
    output = await code.call(trace, "python", {"code": source}, task_id=task_id)
    return output if output.startswith("Error:") else json.loads(output)


def pool_of(code: CodeClient) -> InterpreterPool:
    resources = served_resources(code.http)["code"]
    assert isinstance(resources, CodeResources) and resources.interpreters is not None
    return resources.interpreters


async def peek(code: CodeClient, trace: str, source: str) -> str | None:
    """The value of `source` run in the rollout's live interpreter, as the server holds it (a graded
    rollout's tools take no more calls, so the test looks through the pool)."""
    pool = pool_of(code)
    interpreter = pool.live[trace]
    async with interpreter.lock:
        result = await interpreter.cell(source, {}, pool.limits)
    assert result.exception is None, result.exception
    return result.value


async def grade(code: CodeClient, trace: str, item: dict[str, Any]) -> httpx.Response:
    return await code.http.post("/grade/code", json={"sample": {}, "item": item, "trace_id": trace})


async def score(code: CodeClient, trace: str, item: dict[str, Any]) -> float:
    response = await grade(code, trace, item)
    assert response.status_code == 200, response.text
    return float(response.json()["score"])


async def files_of(code: CodeClient, trace: str, task_id: str | None = None) -> dict[str, str]:
    """The rollout's workspace as its tools see it."""
    listed = json.loads(await code.call(trace, "list_files", {}, task_id=task_id))
    return {
        entry["path"]: await code.call(trace, "read_file", {"path": entry["path"]}, task_id=task_id)
        for entry in listed
    }


async def test_a_solution_only_in_the_workspace_is_graded_from_it(code_app: Any, backend: str) -> None:
    """The row's own tests against solution.py, which the agent wrote from its interpreter only."""
    async with code_app(code=FAST) as code:
        right, wrong, missing = new_trace(), new_trace(), new_trace()
        await cell(code, right, f"open('solution.py', 'w').write({RIGHT!r})")
        await cell(code, wrong, f"open('solution.py', 'w').write({WRONG!r})")
        await code.write(missing, "notes.txt", "no solution here")
        scores = [await score(code, t, {"tests": ADD_TESTS}) for t in (right, wrong, missing)]
        flags = await code.flags(missing)
        # The same rollouts graded in the interpreter: the function was never defined there.
        in_interpreter = await score(code, right, {"tests": ADD_TESTS, "check_in": "interpreter"})
    assert scores == [1.0, 0.0, 0.0]
    assert "no_solution" in flags
    assert in_interpreter == 0.0


async def test_a_grade_in_the_interpreter_sees_what_the_agents_cells_defined(
    code_app: Any, backend: str
) -> None:
    task = all_tasks()["HumanEval/0"]
    body = "\n".join(line for line in task.canonical_solution.splitlines())
    async with code_app(code=FAST) as code:
        trace, wrong = new_trace(), new_trace()
        # The agent solves HumanEval/0 in its interpreter only: solution.py keeps the stub.
        defined = await cell(
            code, trace, task.prompt + body + "\nhas_close_elements([1.0, 2.0], 0.5)", task_id=task.task_id
        )
        assert defined["value"] == "False", defined
        await cell(code, trace, "answer = 6 * 7", task_id=task.task_id)
        await cell(
            code,
            wrong,
            "def has_close_elements(numbers, threshold):\n    return True\n",
            task_id=task.task_id,
        )
        interpreter = {"task_id": task.task_id, "check_in": "interpreter"}
        in_interpreter = await score(code, trace, interpreter)
        in_workspace = await score(code, trace, {"task_id": task.task_id})
        wrong_score = await score(code, wrong, interpreter)
        # A row's own tests may read the agent's variables.
        variables = {"tests": {"test": "assert answer == 42\nassert callable(has_close_elements)\n"}}
        seen = await score(code, trace, {**variables, "check_in": "interpreter"})
        unseen = await score(
            code, trace, {"tests": {"test": "assert answer == 41\n"}, "check_in": "interpreter"}
        )
        # Graded again: a grade changes nothing the next one (or the agent) sees.
        again = await score(code, trace, interpreter)
    assert (in_interpreter, in_workspace, wrong_score) == (1.0, 0.0, 0.0)
    assert (seen, unseen, again) == (1.0, 0.0, 1.0)


TAMPER = textwrap.dedent(
    """\
    import os, subprocess, sys
    for path in ("solution.py", "/workspace/solution.py"):
        try:
            with open(path, "w") as handle:
                handle.write("def add(a, b):\\n    return 0\\n")
        except OSError:
            pass
    for path in ("/workspace/notes.txt", "notes.txt"):
        try:
            os.unlink(path)
        except OSError:
            pass
    os.makedirs("/workspace/planted", exist_ok=True)
    open("/workspace/planted/evil.py", "w").write("x = 1\\n")
    try:
        os.chmod("/workspace/planted", 0o500)  # the driver's rights to remove it taken away
    except OSError:
        pass
    # A process that goes on writing after the check, in a session of its own.
    LATER = "from time import sleep\\nwhile 1:\\n    open('/workspace/l', 'w').write('x')\\n    sleep(0.01)"
    NULL = subprocess.DEVNULL
    subprocess.Popen(
        [sys.executable, "-c", LATER], start_new_session=True, stdin=NULL, stdout=NULL, stderr=NULL
    )
    """
)


@pytest.mark.parametrize("place", ["workspace", "interpreter"])
async def test_a_check_cannot_change_the_agents_files_or_state(
    code_app: Any, place: str, backend: str
) -> None:
    tests = {
        # In the interpreter the agent defined no `add`: the test code alone is the check there.
        "entry_point": "add" if place == "workspace" else "",
        "test": TAMPER + "marker = 'changed by the check'\ndef check(candidate):\n    pass\n",
    }
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await code.write(trace, "solution.py", RIGHT)
        await code.write(trace, "notes.txt", "the agent's notes")
        await cell(code, trace, "marker = 'the agent'\nimport os\nsorted(os.listdir('.'))")
        # A directory of the agent's that nobody may enter: kept, contents and mode, through the checks.
        await cell(
            code, trace, "os.mkdir('private')\nopen('private/k', 'w').write('k')\nos.chmod('private', 0)"
        )
        before = await files_of(code, trace)
        first = await score(code, trace, {"tests": tests, "check_in": place})
        second = await score(code, trace, {"tests": tests, "check_in": place})
        after = await files_of(code, trace)
        await asyncio.sleep(0.3)  # time for a leftover writer to write, were it still running
        box = await peek(
            code,
            trace,
            "import os\nmode = os.stat('.').st_mode & 0o200\nprivate = os.stat('private').st_mode & 0o777\n"
            "os.chmod('private', 0o700)\nk = open('private/k').read()\n"
            "(marker, sorted(os.listdir('.')), open('solution.py').read(), mode, private, k)",
        )
    assert (first, second) == (1.0, 1.0)  # each check ran to its end
    assert after == before and before["solution.py"] == RIGHT and before["notes.txt"] == "the agent's notes"
    # The interpreter's own box: its variable, files and rights are the agent's, nothing the check left.
    assert box == repr(("the agent", sorted([*before, "private"]), RIGHT, 0o200, 0, "k")), box


async def test_a_grade_in_a_gone_interpreter_is_refused_not_scored(code_app: Any, backend: str) -> None:
    async with code_app(code=FAST) as code:
        stopped, never, expired = new_trace(), new_trace(), new_trace()
        item = {"tests": {"test": "assert x == 1\n"}, "check_in": "interpreter"}
        for trace in (stopped, expired):
            await cell(code, trace, "x = 1")
        await pool_of(code).discard(stopped, "it was idle for more than 600 seconds")
        gone = await grade(code, stopped, item)
        await code.write(never, "solution.py", RIGHT)
        never_used = await grade(code, never, item)
        never_flags = await code.flags(never)
        await forget_state(backend, expired)
        expired_grade = await grade(code, expired, item)
        after = await cell(code, stopped, "x")
    assert gone.status_code == 409, gone.text
    assert gone.json()["error"]["code"] == "rollout_state_gone"
    assert "interpreter is gone (it was idle for more than 600 seconds)" in gone.json()["error"]["message"]
    # A rollout that never used the interpreter defined nothing there: that is a 0, said with a flag.
    assert never_used.json() == {"score": 0.0} and "no_interpreter" in never_flags
    assert expired_grade.status_code == 409 and expired_grade.json()["error"]["code"] == "rollout_state_gone"
    assert isinstance(after, str) and after.startswith(f"Error: {RESTARTED}")


async def test_a_grade_in_another_workers_interpreter_is_refused(code_app: Any, backend: str) -> None:
    """Two servers over one state store: the grade reaches the one without the interpreter."""
    trace = new_trace()
    item = {"tests": {"test": "assert x == 1\n"}, "check_in": "interpreter"}
    async with code_app(code=FAST) as first:
        await cell(first, trace, "x = 1")
        async with code_app(code=FAST) as second:
            elsewhere = await grade(second, trace, item)
        here = await score(first, trace, item)
    assert elsewhere.status_code == 409, elsewhere.text
    assert "another server process" in elsewhere.json()["error"]["message"]
    assert here == 1.0


def hostile_test(port: int, host_file: Path) -> str:
    """Test code that tries to get out; it passes only when every attempt failed."""
    return textwrap.dedent(
        f"""\
        import os, socket
        escaped = []
        for where in (("127.0.0.1", {port}), ("1.1.1.1", 53)):
            try:
                socket.create_connection(where, timeout=1).close()
                escaped.append(f"connected to {{where}}")
            except OSError:
                pass
        try:
            open({str(host_file)!r}, "w").write("out")
            escaped.append("wrote a host file")
        except OSError:
            pass
        for secret in ("/etc/shadow", {str(host_file.parent / "secret.txt")!r}):
            try:
                open(secret).read()
                escaped.append(f"read {{secret}}")
            except OSError:
                pass
        if os.getuid() == 0:
            escaped.append("root")
        try:
            os.kill(1, 9)
        except OSError:
            pass
        assert not escaped, escaped
        """
    )


@pytest.mark.parametrize("place", ["workspace", "interpreter"])
async def test_a_hostile_check_stays_contained(
    code_app: Any, place: str, tmp_path: Path, backend: str
) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    (tmp_path / "secret.txt").write_text("host secret")
    host_file = tmp_path / f"escaped-{uuid.uuid4().hex}.txt"
    try:
        async with code_app(code=FAST) as code:
            trace = new_trace()
            await code.write(trace, "solution.py", RIGHT)
            await cell(code, trace, "x = 1")
            test = hostile_test(port, host_file) + "def check(candidate):\n    assert candidate(2, 3) == 5\n"
            tests = {"test": test, "entry_point": "add" if place == "workspace" else ""}
            result = await score(code, trace, {"tests": tests, "check_in": place})
            still = await peek(code, trace, "x")
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert result == 1.0  # every attempt failed inside the sandbox
    assert not host_file.exists()
    assert still == "1"


async def test_a_check_that_kills_the_interpreter_scores_0_and_the_state_is_said_lost(
    code_app: Any, backend: str
) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(
            code, trace, "def add(a, b):\n    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n"
        )
        killed = await score(code, trace, {"tests": ADD_TESTS, "check_in": "interpreter"})
        flags = await code.flags(trace)
        again = await grade(code, trace, {"tests": ADD_TESTS, "check_in": "interpreter"})
        pool = pool_of(code)
    assert killed == 0.0 and "interpreter_stopped" in flags
    # A regrade scores the same: the rollout's own function stopped it, which no retry undoes.
    assert again.status_code == 200 and again.json() == {"score": 0.0}, again.text
    assert trace not in pool.live


@pytest.mark.parametrize(
    "last_cell", ["import os\nos._exit(0)", "while True:\n    pass"], ids=["exit", "past-its-time"]
)
async def test_a_rollout_that_stops_its_own_interpreter_in_its_last_cell_scores_0_not_a_refusal(
    code_app: Any, backend: str, last_cell: str
) -> None:
    """A refusal (409) makes the trainer retry the grade and then drop the rollout: a failing rollout
    would escape its 0 by crashing its box in its last call."""
    async with code_app(code={"interpreter_cell_seconds": 1.0}) as code:
        trace, idle = new_trace(), new_trace()
        await cell(code, trace, "def add(a, b):\n    return a - b\n")
        stopped = await cell(code, trace, last_cell)
        graded = await grade(code, trace, {"tests": ADD_TESTS, "check_in": "interpreter"})
        flags = await code.flags(trace)
        # Stopped for any other reason, the state is gone and the grade refused, as before.
        await cell(code, idle, RIGHT)
        await pool_of(code).discard(idle, "it was idle for more than 600 seconds")
        refused = await grade(code, idle, {"tests": ADD_TESTS, "check_in": "interpreter"})
    assert isinstance(stopped, str) and stopped.startswith("Error: "), stopped
    assert graded.status_code == 200 and graded.json() == {"score": 0.0}, graded.text
    assert "interpreter_stopped" in flags
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "rollout_state_gone"


@pytest.mark.parametrize("entry_point", ["", "add"], ids=["asserts", "entry-point"])
async def test_a_grade_in_the_interpreter_sees_the_files_written_after_the_last_cell(
    code_app: Any, backend: str, entry_point: str
) -> None:
    """write_file after the last cell: the rollout's final workspace holds it (its next cell would see
    it), so the check sees it too (the agent's function reads it, or the asserts do); the interpreter's
    own files are put back after the grade."""
    reads = "open('data.txt').read() == 'final' and not __import__('os').path.exists('gone.txt')"
    tests = {
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"
        if entry_point
        else f"assert x == 1\nassert {reads}\n",
        "entry_point": entry_point,
    }
    RIGHT = f"def add(a, b):\n    return a + b if {reads} else 0\n"
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(
            code,
            trace,
            f"x = 1\n{RIGHT}open('data.txt', 'w').write('draft')\nopen('gone.txt', 'w').write('')",
        )
        await code.write(trace, "data.txt", "final")
        await code.write(trace, "rm.py", "import os\nos.remove('gone.txt')\n")
        await code.run(trace, "rm.py")
        graded = await score(code, trace, {"tests": tests, "check_in": "interpreter"})
        box = await peek(code, trace, "sorted(__import__('os').listdir('.')), open('data.txt').read()")
    assert graded == 1.0
    # The interpreter's own box is put back as the cells left it (its next cell is given the rollout's).
    assert box == repr((["data.txt", "gone.txt"], "draft"))


async def test_a_malformed_row_is_a_configuration_error(code_app: Any, backend: str) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await code.write(trace, "solution.py", RIGHT)
        place = await grade(code, trace, {"tests": ADD_TESTS, "check_in": "elsewhere"})
        test = await grade(code, trace, {"tests": {"entry_point": "add", "test": 3}})
        entry = await grade(code, trace, {"tests": {"test": "assert True\n"}})
        unknown = await grade(code, trace, {"task_id": "HumanEval/9999"})  # no such task, no tests
        neither = await grade(code, trace, {})
    for response in (place, test, entry, unknown, neither):
        assert response.status_code == 422, response.text
        assert response.json()["error"]["code"] == "grader_config_error"
    assert "HumanEval/9999" in unknown.json()["error"]["message"]


WRITE_EVERYWHERE = (
    "import os\n"
    "for name in os.listdir('/proc/self/fd'):\n"
    "    try:\n"
    "        os.write(int(name), b'LEAK')\n"
    "    except OSError:\n"
    "        pass\n"
)


async def test_what_a_check_writes_never_reaches_a_later_cells_output(code_app: Any, backend: str) -> None:
    """A check runs in a fork of the interpreter: whatever descriptor it finds and writes to, the next
    cell's output holds only what that cell printed."""
    tests = {"entry_point": "", "test": WRITE_EVERYWHERE + "def check(candidate):\n    pass\n"}
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, "x = 1")
        await score(code, trace, {"tests": tests, "check_in": "interpreter"})
        pool = pool_of(code)
        interpreter = pool.live[trace]
        async with interpreter.lock:
            after = await interpreter.cell("print('clean')\nx", {}, pool.limits)
    assert (after.stdout, after.stderr, after.value) == (b"clean\n", b"", "1")


# A cell runs in the interpreter's driver process: from the cell, frame 2 is the driver's `cell` method.
FORGED_VERDICTS = (
    "import sys\n"
    "driver = sys._getframe(2).f_locals['self']\n"
    "def add(a, b):\n"
    "    return a - b\n"
    "def passed(request):\n"
    "    return {'id': request['id'], 'passed': True, 'error': None, 'timed_out': False, 'restored': True}\n"
    "driver.check = driver.serve_calls = driver.judge = passed\n"
)
CLAIMS_EQUALITY = (
    "import builtins\n"
    "class Anything:\n"
    "    def __eq__(self, other):\n"
    "        return True\n"
    "def add(a, b):\n"
    "    return Anything()\n"
    "builtins.AssertionError = type('Never', (Exception,), {})\n"
)


@pytest.mark.parametrize(
    "hack", [FORGED_VERDICTS, CLAIMS_EQUALITY], ids=["forged-verdict", "claims-equality"]
)
async def test_the_rollouts_code_cannot_pass_a_grade_in_its_interpreter(
    code_app: Any, backend: str, hack: str
) -> None:
    """The hidden tests of a row with an entry point run in a judge no cell ever ran in; the rollout's
    interpreter only answers the calls, with plain values: a cell that rewrites the driver's verdicts,
    claims equality or patches builtins there gets no pass."""
    async with code_app(code=FAST) as code:
        trace, honest = new_trace(), new_trace()
        await cell(code, trace, hack)
        await cell(code, honest, RIGHT)
        hacked = await score(code, trace, {"tests": ADD_TESTS, "check_in": "interpreter"})
        flags = await code.flags(trace)
        passed = await score(code, honest, {"tests": ADD_TESTS, "check_in": "interpreter"})
        honest_flags = await code.flags(honest)
    assert (hacked, passed) == (0.0, 1.0)
    assert "check_in_agent_process" not in flags and "check_in_agent_process" not in honest_flags


async def test_a_grade_of_tests_without_an_entry_point_says_it_ran_in_the_agents_process(
    code_app: Any, backend: str
) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, "answer = 42")
        result = await score(
            code, trace, {"tests": {"test": "assert answer == 42\n"}, "check_in": "interpreter"}
        )
        flags = await code.flags(trace)
    assert result == 1.0
    assert "its code could change their verdict" in flags["check_in_agent_process"]


async def test_a_judge_that_cannot_start_is_an_outage_and_the_interpreter_is_kept(
    code_app: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with code_app(code={**FAST, "interpreter_spares": 0}) as code:
        trace = new_trace()
        await cell(code, trace, RIGHT + "x = 7")
        pool = pool_of(code)

        async def no_session() -> Any:
            raise OSError("no process slots")

        monkeypatch.setattr(pool, "_start_session", no_session)
        refused = await grade(code, trace, {"tests": ADD_TESTS, "check_in": "interpreter"})
        monkeypatch.undo()
        kept = await peek(code, trace, "x")
        graded = await score(code, trace, {"tests": ADD_TESTS, "check_in": "interpreter"})
    assert refused.status_code == 503, refused.text
    assert kept == "7"  # the rollout's interpreter is as it was
    assert graded == 1.0


async def test_an_answer_too_large_to_send_fails_the_call_not_the_interpreter(
    code_app: Any, backend: str
) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, "def add(a, b):\n    return 'x' * 20_000_000\nkept = 3")
        result = await score(code, trace, {"tests": ADD_TESTS, "check_in": "interpreter"})
        flags = await code.flags(trace)
        kept = await peek(code, trace, "kept")
    assert result == 0.0 and "interpreter_stopped" not in flags
    assert kept == "3"  # the interpreter lives on: a later grade or call finds its state


# The entry point answers a grade's call with a frame of its own making (its caller, the driver's
# `answer_calls`, holds the way out and the request's id), skipping the driver's cap on an answer's size.
FORGED_ANSWER = (
    "import json, struct, sys, os\n"
    "def add(a, b):\n"
    "    caller = sys._getframe(1).f_locals\n"
    "    line = {line}\n"
    "    body = json.dumps({{'id': caller['request_id'], 'line': line}}).encode()\n"
    "    with open(caller['replies'], 'wb', closefd=False) as pipe:\n"
    "        pipe.write(struct.pack('>I', len(body)) + body)\n"
    "    os._exit(0)\n"
)


async def judged_in(
    code: CodeClient, trace: str, seconds: float = 20.0, tests: dict[str, str] = ADD_TESTS
) -> Any:
    """The verdict of `tests` judged against the rollout's live interpreter, as a grade gets it."""
    pool = pool_of(code)
    interpreter = pool.live[trace]
    async with interpreter.lock, pool.judge() as judge:
        return await interpreter.judged(judge, tests, seconds, {})


async def test_an_answer_over_the_cap_that_skips_the_driver_reaches_the_judge_as_a_failed_call(
    code_app: Any, backend: str
) -> None:
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, FORGED_ANSWER.format(line="json.dumps({'value': 'x' * (5 << 20)})"))
        verdict = await judged_in(code, trace)
    assert not verdict.passed and not verdict.timed_out
    assert verdict.error is not None and "too large to send" in verdict.error, verdict.error


async def test_answers_that_exhaust_the_judges_memory_fail_the_grade_never_an_outage(
    code_app: Any, backend: str
) -> None:
    """Answers within the cap can still be costly to decode (deep nests of lists): a judge killed at its
    memory cap holding them fails the grade (a retry would end the same way), never a 503."""
    nests = "'{\"value\": [' + ','.join(['[' * 40 + ']' * 40] * 40000) + ']}'"
    async with code_app(code={**FAST, "run_memory_bytes": 96 << 20}) as code:
        if not pool_of(code).sandbox.memory.per_run:
            pytest.skip("this machine gives a run no memory cgroup of its own")
        trace = new_trace()
        await cell(code, trace, FORGED_ANSWER.format(line=nests))
        verdict = await judged_in(code, trace)
        response = await grade(code, trace, {"tests": ADD_TESTS, "check_in": "interpreter"})
    assert not verdict.passed
    assert verdict.error is not None and "ran out of memory" in verdict.error, verdict.error
    assert response.status_code == 200 and response.json()["score"] == 0.0, response.text


async def test_an_answer_cut_by_the_grades_time_limit_is_read_whole_and_the_interpreter_kept(
    code_app: Any, backend: str
) -> None:
    """The grade's time runs out between an answer's size and its body: the grade is timed out, and the
    interpreter, whose frames are read on from where the cut left them, lives on with its state."""
    slow = (
        "import json, struct, sys, time\n"
        "def add(a, b):\n"
        "    caller = sys._getframe(1).f_locals\n"
        "    body = json.dumps({'id': caller['request_id'], 'line': json.dumps({'value': a + b})}).encode()\n"
        "    with open(caller['replies'], 'wb', buffering=0, closefd=False) as pipe:\n"
        "        pipe.write(struct.pack('>I', len(body)) + body[:10])\n"
        "        time.sleep(3)\n"
        "        pipe.write(body[10:])\n"
        "    return a + b\n"
        "kept = 11\n"
    )
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, slow)
        verdict = await judged_in(code, trace, seconds=1.5)
        kept = await peek(code, trace, "kept")
    assert (verdict.passed, verdict.timed_out) == (False, True), verdict
    assert kept == "11"


async def test_a_fork_that_answers_without_reading_its_calls_ends_the_grade_never_hangs_it(
    code_app: Any, backend: str
) -> None:
    """The entry point floods its answers and never reads the next call: the server, sending a call too
    large for the pipes, stops reading answers, and the driver, relaying them, waits for the server. The
    grade's time bounds every step of it, the end's sending too: the interpreter is stopped, the grade
    answered."""
    flood = (
        "import json, struct, sys\n"
        "def add(a, b):\n"
        "    caller = sys._getframe(1).f_locals\n"
        "    body = json.dumps({'id': caller['request_id'], 'line': json.dumps({'value': 1})}).encode()\n"
        "    with open(caller['replies'], 'wb', closefd=False) as pipe:\n"
        "        while True:\n"
        "            pipe.write(struct.pack('>I', len(body)) + body)\n"
    )
    big_calls = {
        "entry_point": "add",
        "test": "def check(candidate):\n    for _ in range(3):\n        candidate('x' * 400_000, 1)\n",
    }
    async with code_app(code=FAST) as code:
        trace = new_trace()
        await cell(code, trace, flood)
        with pytest.raises(InterpreterStopped):
            await asyncio.wait_for(judged_in(code, trace, seconds=1.0, tests=big_calls), 60)
