"""bench.runner still runs end to end in a tiny smoke mode (an instant target subprocess, a few rollouts)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import runner


def test_runner_bench_runs(tmp_path: Path) -> None:
    code = runner.main(
        ["--policies", "scripted,chat", "--rounds", "1", "--rollouts", "4", "--concurrency", "4",
         "--turns", "2", "--calls", "2", "--results-dir", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    (out,) = tmp_path.glob("runner-*.json")
    result = json.loads(out.read_text())
    runs = {run["policy"]: run for run in result["runs"]}
    for policy in ("scripted", "chat"):
        assert runs[policy]["rollouts"] == 4 and runs[policy]["graded"] == 4
        assert runs[policy]["tool_calls"] == 4 * 2 * 2
        assert runs[policy]["runner_cpu_ms_per_call"] > 0
