"""The benchmark drivers still run end to end: bench.run and bench.grading in a tiny smoke mode.

Each starts its servers as subprocesses and runs wrk for one second per run; skipped without wrk. The
grading smoke takes a Redis database no live benchmark owns (bench.run.take_redis_db), so it never
flushes a real run's keys.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import ab, grading, run

pytestmark = pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")


def test_tool_route_bench_runs(tmp_path: Path) -> None:
    code = run.main(
        [
            "--scenarios",
            "echo,trivial-embedded,mcp-trivial-embedded",
            "--rounds",
            "1",
            "--duration",
            "1",
            "--warmup",
            "0",
            "--pause",
            "0",
            "--rate",
            "0",
            "--results-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    (out,) = tmp_path.glob("bench-*.json")
    result = json.loads(out.read_text())
    rows = {row["scenario"]: row for row in result["summary"]}
    assert rows["echo"]["answered_2xx"] > 0
    assert rows["trivial-embedded"]["answered_2xx"] > 0
    assert rows["trivial-embedded"]["non_2xx_or_errors"] == 0
    assert rows["mcp-trivial-embedded"]["answered_2xx"] > 0
    assert rows["mcp-trivial-embedded"]["non_2xx_or_errors"] == 0
    assert rows["mcp-trivial-embedded"]["ratio_to_tool_route"] > 0
    assert all(line.endswith(": ok") for line in result["log_checks"])


def test_grading_bench_runs(tmp_path: Path) -> None:
    code = grading.main(
        [
            "--rounds",
            "1",
            "--duration",
            "1",
            "--rollouts",
            "2",
            "--calls",
            "5",
            "--graders",
            "string,trace_multi",
            "--results-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    (out,) = tmp_path.glob("grading-*.json")
    rows = {row["grader"]: row for row in json.loads(out.read_text())["summary"]}
    assert rows["string"]["score"] == 1.0
    assert 0.0 < rows["trace_multi"]["score"] < 1.0
    assert all(row["grades_per_s"] > 0 and row["non_2xx_or_errors"] == 0 for row in rows.values())


@pytest.mark.skipif(
    shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
    reason="valgrind is not installed",
)
def test_instruction_count_bench_runs(tmp_path: Path) -> None:
    from bench import instructions

    code = instructions.main(
        ["--scenarios", "echo", "--duration", "2", "--warmup", "1", "--results-dir", str(tmp_path)]
    )
    assert code == 0
    (out,) = tmp_path.glob("instructions-*.json")
    (row,) = json.loads(out.read_text())["results"]
    assert row["scenario"] == "echo"
    assert row["calls"] > 0
    # A bare FastAPI call is hundreds of thousands of instructions: a count near zero means callgrind
    # measured nothing (collection never switched on, or the wrong dump was read).
    assert row["instructions_per_call"] > 50_000
    assert row["x_echo"] == 1.0


def test_callgrind_total_is_read_from_the_totals_line(tmp_path: Path) -> None:
    from bench.instructions import callgrind_total

    dump = tmp_path / "callgrind.out.1"
    dump.write_text("events: Ir\nsummary: 0\nfn=main\n0 5\ntotals: 123456\n")
    assert callgrind_total(dump) == 123456
    dump.write_text("events: Ir\nsummary: 7\n")
    with pytest.raises(RuntimeError, match="no instruction total"):
        callgrind_total(dump)


def test_ab_bench_compares_two_checkouts(tmp_path: Path) -> None:
    root = Path(run.ROOT)
    code = ab.main(
        [
            "--variant",
            f"one={root}",
            "--variant",
            f"two={root}",
            "--scenario",
            "retail-write",
            "--rounds",
            "1",
            "--duration",
            "1",
            "--warmup",
            "0",
            "--rollouts",
            "8",
            "--results-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    (out,) = tmp_path.glob("ab-*.json")
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"one", "two"}
    for row in summary.values():
        assert row["ratio_median"] > 0 and row["errors"] == 0
    with pytest.raises(SystemExit):
        ab.main(["--variant", f"one={root}", "--variant", f"two={tmp_path}"])  # not a checkout
