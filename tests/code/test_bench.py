"""bench.code, bench.interpreter, bench.pauses and bench.warm still run end to end, in a tiny mode."""

from __future__ import annotations

import json
from pathlib import Path

from bench import code, interpreter, pauses, warm


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
    argv = ["--cells", "3", "--live", "2", "--first", "2", "--arrival", "0.3", "--results-dir", str(tmp_path)]
    assert interpreter.main(argv) == 0
    (result,) = tmp_path.glob("interpreter-*.json")
    report = json.loads(result.read_text())
    assert report["sandbox"] == "bwrap" and report["cell"]["n"] == 3 and report["live"] == 2
    assert report["rss_per_interpreter_mib"] > 1  # the trees were found and measured
    first = report["first_call"]
    assert first["spares"] >= 1 and first["with_spares"]["n"] == first["without_spares"]["n"] == 2


def test_the_warm_bench_runs(tmp_path: Path) -> None:
    args = [
        "--calls",
        "3",
        "--grades",
        "2",
        "--rounds",
        "1",
        "--concurrency",
        "2",
        "--results-dir",
        str(tmp_path),
    ]
    assert warm.main(args) == 0
    (result,) = tmp_path.glob("warm-*.json")
    report = json.loads(result.read_text())
    served = report["run_python_http"]
    assert served["health"]["warm"]["path"] == "warm" and served["health"]["cold"]["path"] == "cold"
    assert served["warm"]["n"] == 3 and served["bare"]["n"] == 3 and served["write_file"]["n"] == 3
    assert served["python_cell"]["n"] == 3
    grades = report["grades"]
    assert grades["tasks"] == 2 and all(grades["per_s"][kind] > 0 for kind in ("warm", "cold", "plain"))
    assert grades["sandbox_layer"]["warm_run"]["n"] == 3


def test_the_pauses_bench_runs(tmp_path: Path) -> None:
    assert pauses.main(["--pauses", "0,5", "--calls", "3", "--results-dir", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("pauses-*.json")
    report = json.loads(result.read_text())
    assert sorted(report["pauses_ms"]) == ["0", "5"]
    assert all(entry["n"] == 3 and entry["p50_ms"] > 0 for entry in report["pauses_ms"].values())
