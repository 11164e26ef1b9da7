"""bench.code and bench.interpreter still run end to end, in a tiny mode."""

from __future__ import annotations

import json
from pathlib import Path

from bench import code, interpreter


def test_the_code_bench_runs(tmp_path: Path) -> None:
    assert (
        code.main(["--runs", "3", "--grades", "2", "--concurrency", "2", "--results-dir", str(tmp_path)]) == 0
    )
    (result,) = tmp_path.glob("code-*.json")
    report = json.loads(result.read_text())
    assert report["sandbox"] == "bwrap"
    assert report["run_python"]["n"] == 3 and report["grades"]["count"] == 2
    assert report["grades"]["per_s"] > 0 and report["run_python"]["p50_ms"] > 0


def test_the_interpreter_bench_runs(tmp_path: Path) -> None:
    assert interpreter.main(["--cells", "3", "--live", "2", "--results-dir", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("interpreter-*.json")
    report = json.loads(result.read_text())
    assert report["sandbox"] == "bwrap" and report["cell"]["n"] == 3 and report["live"] == 2
    assert report["rss_per_interpreter_mib"] > 1  # the trees were found and measured
