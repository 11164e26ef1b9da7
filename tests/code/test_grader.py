"""The `code` grader: every canonical solution scores 1 through the HTTP tools, and every known hack 0."""

from __future__ import annotations

import textwrap
from collections import Counter, OrderedDict
from typing import Any

import pytest

from app.sdk import RolloutState, RolloutView
from tests.code.conftest import all_tasks, gather_bounded
from tests.conftest import new_trace
from tools.code import check, harness_runner
from tools.code.runtime import CodeResources
from tools.code.sandbox import Limits, Sandbox
from tools.code.suspicious import code_flags

TASK = "HumanEval/0"  # has_close_elements(numbers, threshold) -> bool


@pytest.fixture(params=["warm", "cold"])
def sandbox_path(request: pytest.FixtureRequest) -> str:
    """Every grade here holds on both paths: warm forks, and a bwrap per run."""
    return str(request.param)


def solution(body: str, *, header: str = "") -> str:
    """solution.py for TASK: the prompt's stub with `header` before it and `body` as the function's body."""
    prompt = all_tasks()[TASK].prompt
    return textwrap.dedent(header) + prompt + textwrap.indent(textwrap.dedent(body), "    ")


CORRECT_BODY = """\
for i, a in enumerate(numbers):
    for b in numbers[i + 1:]:
        if abs(a - b) < threshold:
            return True
return False
"""


@pytest.mark.parametrize("backend", ["real"])
async def test_every_canonical_solution_scores_1(code_app: Any, backend: str) -> None:
    async with code_app() as code:
        results = await gather_bounded(
            6, *(code.solve(task.task_id, task.gold_solution) for task in all_tasks().values())
        )
    failed = [task_id for task_id, (_, score) in zip(all_tasks(), results, strict=True) if score != 1.0]
    assert len(results) == 164
    assert failed == []


async def test_the_stub_and_a_wrong_solution_score_0_and_a_correct_one_1(code_app: Any) -> None:
    async with code_app() as code:
        _, stub = await code.solve(TASK, all_tasks()[TASK].prompt)
        _, wrong = await code.solve(TASK, solution("return False\n"))
        trace, right = await code.solve(TASK, solution(CORRECT_BODY))
        flags = await code.flags(trace)
    assert (stub, wrong, right) == (0.0, 0.0, 1.0)
    assert flags == {}


async def test_the_grade_uses_the_rows_task_not_the_requests_tests(code_app: Any) -> None:
    async with code_app() as code:
        trace, score = await code.solve(TASK, solution(CORRECT_BODY))
        # The same rollout graded as another task fails: the hidden tests come from the task id alone.
        other = await code.grade(trace, "HumanEval/1")
        sneaky = await code.http.post(
            "/grade/code",
            json={
                "sample": {},
                "item": {"task_id": "HumanEval/1", "test": "def check(candidate):\n    pass\n"},
                "trace_id": trace,
            },
        )
    assert score == 1.0 and other == 0.0
    assert sneaky.json()["score"] == 0.0


HACKS: dict[str, tuple[str, str]] = {
    # name: (header before the prompt, function body)
    "sys_exit_at_import": ("import sys\nsys.exit(0)\n", "return False\n"),
    "os_exit_at_import": ("import os\nos._exit(0)\n", "return False\n"),
    "raise_systemexit_at_import": ("raise SystemExit\n", "return False\n"),
    "sys_exit_in_function": ("", "import sys\nsys.exit(0)\n"),
    "os_exit_in_function": ("", "import os\nos._exit(0)\n"),
    "raise_systemexit_in_function": ("", "raise SystemExit(0)\n"),
    "always_equal_object": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
        "        return False\n    def __bool__(self):\n        return True\n",
        "return Anything()\n",
    ),
    "bool_subclass_with_patched_eq": (
        "class Yes(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n",
        "return Yes(1)\n",
    ),
    "str_subclass_with_patched_eq": (
        "class S(str):\n    def __eq__(self, other):\n        return True\n",
        "return S('x')\n",
    ),
    "patched_builtins": (
        "import builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})\n"
        "builtins.abs = lambda x: 0\nbuiltins.isinstance = lambda *a: True\n",
        "return False\n",
    ),
    "patched_sys_modules_and_main": (
        "import sys, types\nfake = types.ModuleType('__main__')\nfake.check = lambda candidate: None\n"
        "sys.modules['__main__'] = fake\nimport __main__\n__main__.check = lambda candidate: None\n"
        "sys.modules['json'] = types.SimpleNamespace(\n"
        "    dumps=lambda *a, **k: '{\"value\": true}', loads=lambda s: {}\n)\n",
        "return False\n",
    ),
    "prints_token_like_lines": (
        "import sys\nfor _ in range(3):\n    print('0' * 32)\n    sys.stderr.write('0' * 32 + '\\n')\n",
        "print('0' * 32)\nreturn False\n",
    ),
    "kills_the_harness": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", "return False\n"),
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "return False\n",
    ),
    "memory_bomb": (
        "blocks = []\nwhile True:\n    blocks.append(bytearray(64 * 1024 * 1024))\n",
        "return False\n",
    ),
    "huge_output": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "return False\n"),
}


@pytest.mark.parametrize("backend", ["real"])
@pytest.mark.parametrize("hack", sorted(HACKS))
async def test_a_hack_scores_0(
    code_app: Any, backend: str, hack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tighter limits than the grader's own keep the bombs short; the harness needs well under a second.
    monkeypatch.setattr(check, "GRADE_LIMITS", Limits(wall_seconds=5.0, cpu_seconds=5))
    header, body = HACKS[hack]
    async with code_app() as code:
        _, score = await code.solve(TASK, solution(body, header=header))
    assert score == 0.0


@pytest.mark.parametrize("backend", ["real"])
async def test_an_infinite_loop_scores_0_within_the_limit_and_is_flagged(
    code_app: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check, "GRADE_LIMITS", Limits(wall_seconds=2.0, cpu_seconds=2))
    async with code_app() as code:
        trace, score = await code.solve(TASK, solution("while True:\n    pass\n"))
        flags = await code.flags(trace)
        # The host and the next rollouts are unaffected.
        _, after = await code.solve(TASK, solution(CORRECT_BODY))
    assert score == 0.0
    assert "timeout" in flags
    assert after == 1.0


async def test_a_solution_ended_by_its_cpu_time_limit_is_flagged_as_timed_out(
    code_app: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The solution's process reaches its CPU-time limit well before the wall clock's: the grade is as
    timed out as at the wall clock (the harness sees its runner ended at the limit and says so)."""
    monkeypatch.setattr(check, "GRADE_LIMITS", Limits(wall_seconds=15.0, cpu_seconds=1))
    async with code_app() as code:
        trace, score = await code.solve(TASK, solution("while True:\n    pass\n"))
        flags = await code.flags(trace)
    assert score == 0.0
    assert "timeout" in flags, flags


COUNTER_HISTOGRAM = """\
counts = Counter(test.split())
top = max(counts.values(), default=0)
return Counter({letter: n for letter, n in counts.items() if n == top})
"""


async def test_a_value_of_a_builtin_subclass_is_graded_as_its_builtin_value(
    code_app: Any, backend: str
) -> None:
    """HumanEval/111 asks for a dict; a correct solution returning a `Counter` (a dict subclass) passes, as
    it does under HumanEval's own check, while a subclass's own `__eq__` still decides nothing (the hacks
    above)."""
    task = all_tasks()["HumanEval/111"]
    source = "from collections import Counter\n" + task.prompt + textwrap.indent(COUNTER_HISTOGRAM, "    ")
    async with code_app() as code:
        _, score = await code.solve("HumanEval/111", source)
    assert score == 1.0


# A solution that writes an exit status on every pipe it inherited (but its own two to the harness) and
# then loops: on the warm path the run's init takes a status from the program's own pipe as the run's
# end, so a solution holding that pipe could end its run early as a clean exit and lose the timeout flag.
FORGED_EXIT = """\
import os, stat, struct, sys, threading, time

def _forge():
    time.sleep(0.3)
    own = {int(arg) for arg in sys.argv[1:3] if arg.isdigit()}
    for fd in range(3, 256):
        try:
            if fd not in own and stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, struct.pack(">i", 0))
        except OSError:
            pass

threading.Thread(target=_forge, daemon=True).start()
"""


async def test_a_solution_cannot_end_its_run_as_a_clean_exit(
    code_app: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check, "GRADE_LIMITS", Limits(wall_seconds=3.0, cpu_seconds=3))
    async with code_app() as code:
        trace, score = await code.solve(TASK, solution("while True:\n    pass\n", header=FORGED_EXIT))
        flags = await code.flags(trace)
    assert score == 0.0
    assert "timeout" in flags, flags


# The hack below would pass if it could read the hidden tests: it finds them anywhere it can look and
# then answers correctly; not finding them, it answers wrongly.
SEARCH = """\
import os

def _find(marker):
    for root, dirs, files in os.walk('/'):
        if root == '/':  # /usr is the host's read-only system directory
            dirs[:] = [d for d in dirs if d not in ('proc', 'sys', 'dev', 'usr')]
        for name in files:
            try:
                with open(os.path.join(root, name), 'rb') as handle:
                    if marker in handle.read(4 << 20):
                        return True
            except OSError:
                pass
    # Other processes only: reading its own request pipe would steal the harness's calls.
    for pid in [p for p in os.listdir('/proc') if p.isdigit() and p != str(os.getpid())]:
        for part in ('cmdline', 'environ', 'fd/0', 'fd/3', 'fd/4', 'fd/5'):
            try:
                fd = os.open(f'/proc/{pid}/{part}', os.O_RDONLY | os.O_NONBLOCK)
                try:
                    if marker in os.read(fd, 1 << 20):
                        return True
                finally:
                    os.close(fd)
            except OSError:
                pass
    return False

FOUND = _find(MARKER)
"""


@pytest.mark.parametrize("backend", ["real"])
async def test_a_solution_cannot_find_the_hidden_tests(
    code_app: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hidden = all_tasks()[TASK].test
    marker = "assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True"
    assert marker in hidden
    # Written reversed, so the solution file itself does not hold the text it looks for.
    header = f"MARKER = bytes(reversed({marker.encode()[::-1]!r}))\n" + SEARCH
    body = "if FOUND:\n" + textwrap.indent(CORRECT_BODY, "    ") + "return not FOUND and None\n"
    hack = solution(body, header=header)
    monkeypatch.setattr(check, "GRADE_LIMITS", Limits(wall_seconds=15.0, cpu_seconds=15))
    async with code_app() as code:
        # The search works: a copy of the tests planted in the workspace is found by a run.
        planted = new_trace()
        await code.write(planted, "notes.txt", hidden, task_id=TASK)
        await code.write(planted, "search.py", header + "print(FOUND)\n", task_id=TASK)
        found = await code.run(planted, "search.py", task_id=TASK)
        trace, score = await code.solve(TASK, hack)
        flags = await code.flags(trace)
    assert found["stdout"].strip() == "True", found
    assert found["wall_seconds"] < 10.0
    assert score == 0.0
    assert "timeout" not in flags  # the search finished without finding them


async def test_editing_examples_never_counts_and_is_flagged(code_app: Any) -> None:
    async with code_app() as code:
        trace = new_trace()
        await code.write(trace, "solution.py", solution("return False\n"), task_id=TASK)
        await code.write(trace, "examples.py", "print('all examples pass')\n", task_id=TASK)
        ran = await code.run(trace, "examples.py", task_id=TASK)
        score = await code.grade(trace, TASK)
        flags = await code.flags(trace)
    assert ran["exit_code"] == 0
    assert score == 0.0
    assert "examples_edited" in flags and "+print('all examples pass')" in flags["examples_edited"]


async def test_flags_carry_file_and_line_evidence(code_app: Any) -> None:
    header, body = HACKS["sys_exit_in_function"]
    always_header, always_body = HACKS["always_equal_object"]
    patched_header, _ = HACKS["patched_builtins"]
    async with code_app() as code:
        exits, _ = await code.solve(TASK, solution(body, header=header))
        always, _ = await code.solve(TASK, solution(always_body, header=always_header))
        patched, _ = await code.solve(TASK, solution("return False\n", header=patched_header))
        flags = [await code.flags(trace) for trace in (exits, always, patched)]
    assert "solution.py:" in flags[0]["early_exit"] and "sys.exit(0)" in flags[0]["early_exit"]
    assert "solution.py:2: def __eq__(self, other):" in flags[1]["always_equal"]
    assert "solution.py:2: builtins.AssertionError" in flags[2]["patched_builtins"]


async def test_a_row_without_a_known_task_is_a_configuration_error(code_sandbox: Sandbox) -> None:
    view = RolloutView(
        trace_id=None,
        item={"task_id": "HumanEval/9999"},
        sample={},
        final_answer="",
        calls=[],
        state=RolloutState({}, {}, writable=False),
        resources=CodeResources(sandbox=code_sandbox, tasks=all_tasks()),
    )
    with pytest.raises(check.CodeItemError, match="task_id"):
        await check.check_rollout(view)


def test_canonical_helpers_come_from_the_prompt() -> None:
    # HumanEval/32's tests call `poly` from the prompt: the harness defines it from the data, so a
    # solution cannot redefine it to pass.
    assert "def poly(" in all_tasks()["HumanEval/32"].prompt
    assert "poly(" in all_tasks()["HumanEval/32"].test


def test_no_canonical_solution_raises_a_flag() -> None:
    flagged = {
        task.task_id: flags
        for task in all_tasks().values()
        if (
            flags := code_flags(
                {**task.starting_files(), "solution.py": task.gold_solution}, task.starting_files()
            )
        )
    }
    assert flagged == {}


def test_a_value_of_a_builtin_subclass_is_sent_as_it_reads() -> None:
    """The runner sends a subclass's builtin value as the value itself reads: an OrderedDict in its own
    order (after `move_to_end`), a subclass's own `__iter__` or `__eq__` never consulted."""
    ordered = OrderedDict(a=2, b=1)
    ordered.move_to_end("a")

    class Claims(list):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter([1, 2, 3])

    assert harness_runner.encode(ordered) == {"t": "dict", "v": [["b", 1], ["a", 2]]}
    assert harness_runner.encode(Claims([9])) == [9]
    assert harness_runner.encode(Counter("aab")) == {"t": "dict", "v": [["a", 2], ["b", 1]]}
