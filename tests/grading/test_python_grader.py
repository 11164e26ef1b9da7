"""The python grader: scores, failures that score 0, timeouts, memory bombs, and a pool that survives them."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest
from rapidfuzz import fuzz, utils

from app.grading.graders import python_pool as pool_module
from app.grading.graders.model import GraderConfigError, GraderUnavailable
from app.grading.graders.python_grader import PythonGrader, grade_arity
from app.grading.graders.python_pool import PythonPool, PythonPoolSettings
from app.grading.graders.registry import GraderContext, build_graders
from tests.grading.records import call, grade_input, rollout

# The python grader example of OpenAI's graders guide.
GUIDE_SOURCE = """
from rapidfuzz import fuzz, utils

def grade(sample, item) -> float:
    output_text = sample["output_text"]
    reference_answer = item["reference_answer"]
    return fuzz.WRatio(output_text, reference_answer, processor=utils.default_process) / 100.0
"""


def grader(source: str, pool: PythonPool) -> PythonGrader:
    return PythonGrader(name="py", version="v", source=textwrap.dedent(source), runner=pool)


async def run(
    pool: PythonPool, body: str, answer: str = "", item: dict[str, object] | None = None
) -> tuple[float, list[str]]:
    source = "def grade(sample, item):\n" + textwrap.indent(textwrap.dedent(body), "    ")
    result = await grader(source, pool).grade(grade_input(answer, item))
    return result.score, result.errors


async def test_the_guide_example(python_pool: PythonPool) -> None:
    result = await grader(GUIDE_SOURCE, python_pool).grade(
        grade_input("The capital of France is Paris", {"reference_answer": "Paris"})
    )
    expected = fuzz.WRatio("The capital of France is Paris", "Paris", processor=utils.default_process) / 100
    assert result.score == pytest.approx(expected)
    assert result.errors == []


@pytest.mark.parametrize(
    ("body", "answer", "expected"),
    [
        ("return 0.75", "", 0.75),
        ("return 1 if sample['output_text'] == item['answer'] else 0", "42", 1.0),
        ("return len(sample['output_text'])", "abcd", 4.0),
        ("return sample['output_text'] == item['answer']", "42", 1.0),  # a bool is a number
        ("return -3.5", "", -3.5),  # not clipped, as on the platform
        ("import math\nreturn math.sqrt(16)", "", 4.0),
        ("print('noise on stdout')\nreturn 0.5", "", 0.5),  # prints cannot corrupt the protocol
    ],
)
async def test_scores(python_pool: PythonPool, body: str, answer: str, expected: float) -> None:
    assert await run(python_pool, body, answer, {"answer": "42"}) == (expected, [])


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("raise ValueError('bad answer')", "ValueError: bad answer (grader line 2)"),
        ("return sample['missing']", "KeyError: 'missing'"),
        ("return 1 / 0", "ZeroDivisionError"),
        ("return float('nan')", "not a finite number"),
        ("return float('inf')", "not a finite number"),
        ("return 10 ** 400", "too large"),
        ("return '0.5'", "returned str '0.5', not a number"),
        ("return None", "returned NoneType"),
        ("import sys\nsys.exit(3)", "SystemExit: 3"),
        ("return input()", "EOFError"),  # stdin is not the protocol
        ("return grade(sample, item)", "RecursionError"),
    ],
)
async def test_failures_score_0_and_are_recorded(python_pool: PythonPool, body: str, error: str) -> None:
    score, errors = await run(python_pool, body, "x")
    assert score == 0.0
    assert len(errors) == 1 and error in errors[0], errors
    assert errors[0].startswith("python grader: ")


async def test_an_infinite_loop_is_killed_and_the_pool_goes_on() -> None:
    pool = PythonPool(PythonPoolSettings(workers=1, timeout=0.5, memory_mb=256))
    try:
        assert await run(pool, "return 0.5") == (0.5, [])
        score, errors = await run(pool, "while True:\n    pass")
        assert score == 0.0 and "longer than 0.5s and was killed" in errors[0]
        assert pool.spawned == 1
        assert await run(pool, "return 0.5") == (0.5, [])
        assert pool.spawned == 2  # the killed worker was replaced
    finally:
        await pool.aclose()


async def test_a_process_the_grader_started_dies_with_its_worker(tmp_path: Path) -> None:
    pool = PythonPool(PythonPoolSettings(workers=1, timeout=0.5, memory_mb=256))
    pidfile = tmp_path / "child.pid"
    try:
        body = (
            "import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "open(item['pidfile'], 'w').write(str(child.pid))\n"
            "time.sleep(60)"
        )
        score, errors = await run(pool, body, item={"pidfile": str(pidfile)})
        assert score == 0.0 and "killed" in errors[0]
        assert await _gone(int(pidfile.read_text()))
    finally:
        await pool.aclose()


def _process_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


async def _gone(pid: int) -> bool:
    """Whether the process is dead (a zombie waiting for its reaper counts), waiting a little for it."""
    for _ in range(500):
        if _process_state(pid) in (None, "Z", "X"):
            return True
        await asyncio.sleep(0.01)
    return False


@pytest.mark.parametrize(
    "body",
    [
        "x = bytearray(8 * 1024 ** 3)\nreturn 1.0",  # one huge allocation
        "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 ** 2))",  # growing until the limit
        "return len('x' * (4 * 1024 ** 3))",
    ],
)
async def test_a_memory_bomb_scores_0_and_the_pool_goes_on(python_pool: PythonPool, body: str) -> None:
    score, errors = await run(python_pool, body)
    assert score == 0.0 and "MemoryError" in errors[0]
    assert await run(python_pool, "return 0.25") == (0.25, [])


async def test_a_worker_that_dies_scores_0_and_is_replaced(python_pool: PythonPool) -> None:
    score, errors = await run(python_pool, "import os\nos._exit(7)")
    assert score == 0.0 and "died (exit code 7)" in errors[0]
    score, errors = await run(python_pool, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert score == 0.0 and "killed by SIGKILL" in errors[0]
    assert await run(python_pool, "return 1") == (1.0, [])


async def test_concurrent_grades_share_the_workers(python_pool: PythonPool) -> None:
    results = await asyncio.gather(*(run(python_pool, f"return {i} / 10") for i in range(10)))
    assert [score for score, _ in results] == [i / 10 for i in range(10)]


async def test_a_cancelled_grade_does_not_confuse_the_next(python_pool: PythonPool) -> None:
    slow = asyncio.ensure_future(run(python_pool, "import time\ntime.sleep(0.5)\nreturn 0.9"))
    await asyncio.sleep(0.2)
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    assert await run(python_pool, "return 0.1") == (0.1, [])


async def test_the_rollout_reaches_a_three_argument_grade(python_pool: PythonPool) -> None:
    source = "def grade(sample, item, rollout):\n    return rollout['tool_calls'] + rollout['errors'] / 10"
    g = grader(source, python_pool)
    assert g.needs_rollout
    record = rollout([call("a"), call("b", outcome="model_error")])
    assert (await g.grade(grade_input("x", record=record))).score == pytest.approx(2.1)
    assert (await g.grade(grade_input("x"))).score == 0.0  # no rollout: zero calls


async def test_workers_see_none_of_the_server_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARRING_JUDGE_API_KEY", "secret-key")
    pool = PythonPool(PythonPoolSettings(workers=1, timeout=2, memory_mb=256))
    try:
        score, errors = await run(
            pool, "import os\nreturn 1.0 if 'SPARRING_JUDGE_API_KEY' not in os.environ else 0.0"
        )
        assert (score, errors) == (1.0, [])
    finally:
        await pool.aclose()


@pytest.mark.parametrize(
    ("source", "arity"),
    [
        ("def grade(sample, item):\n    return 1", 2),
        ("def grade(sample, item, rollout):\n    return 1", 3),
        ("def grade(sample, item, rollout=None):\n    return 1", 3),
        ("def grade(*args):\n    return 1", 2),
        ("grade = lambda sample, item: 1", 2),
        ("from math import floor as grade", 2),
    ],
)
def test_grade_arity(source: str, arity: int) -> None:
    assert grade_arity(source) == arity


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def grade(sample, item)\n    return 1", "syntax error at line 1"),
        ("def grade(sample, item):\nreturn 1", "syntax error"),
        ("def score(sample, item):\n    return 1", "must define a top-level function grade"),
        ("async def grade(sample, item):\n    return 1", "not async"),
        ("def grade(sample):\n    return 1", "grade takes 1 argument"),
        ("def grade(a, b, c, d):\n    return 1", "grade takes 4 argument"),
        ("x = 1", "must define"),
    ],
)
async def test_bad_sources_are_config_errors(context: GraderContext, source: str, message: str) -> None:
    with pytest.raises(GraderConfigError) as caught:
        build_graders({"py": {"type": "python", "source": source}}, source="graders.yaml", context=context)
    assert caught.value.field == "source"
    assert message in caught.value.message


async def test_a_pool_that_cannot_start_workers_is_unavailable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    broken = tmp_path / "worker.py"
    broken.write_text("import sys\nsys.exit(2)\n")  # exits before saying it is ready
    monkeypatch.setattr(pool_module, "WORKER", broken)
    pool = PythonPool(PythonPoolSettings(workers=1, timeout=2, memory_mb=256))
    try:
        with pytest.raises(GraderUnavailable, match=r"failed to start \(exit code 2\)"):
            await grader("def grade(sample, item):\n    return 1", pool).grade(grade_input("x"))
    finally:
        await pool.aclose()


async def test_a_closed_pool_is_unavailable() -> None:
    pool = PythonPool(PythonPoolSettings(workers=2, timeout=2, memory_mb=256))
    await pool.start()
    assert pool.spawned == 2
    assert await run(pool, "return 0.5") == (0.5, [])
    assert pool.spawned == 2  # warm workers were used
    await pool.aclose()
    with pytest.raises(GraderUnavailable, match="closed"):
        await run(pool, "return 0.5")
