"""bench.phases splits calls on the shipped server into the way in, the program and the way out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import phases


def test_phases_bench_splits_run_python_and_a_cell(tmp_path: Path) -> None:
    assert phases.main(["--calls", "3", "--pause", "0", "--results-dir", str(tmp_path)]) == 0
    (out,) = tmp_path.glob("phases-*.json")
    result = json.loads(out.read_text())
    assert result["health"]["path"] == "warm"
    for name in ("run_python", "python_cell"):
        summary = result["results"][name]
        assert summary["n"] == 3
        for phase in ("in", "program", "out"):
            assert 0 <= summary[phase]["p50_ms"] <= summary["total"]["p90_ms"]
        assert 0 <= summary["same_cpu_share"] <= 1


def test_a_program_clock_outside_the_call_is_refused() -> None:
    with pytest.raises(RuntimeError, match="clock"):
        phases.split(started=2.0, first=1.0, last=1.5, ended=3.0, same_cpu=True)
    assert phases.split(1.0, 1.5, 2.0, 3.0, False) == {
        "in": 0.5, "program": 0.5, "out": 1.0, "total": 2.0, "same_cpu": 0.0
    }  # fmt: skip
