"""Where a `run_python` call and a `python` cell spend their time: `python -m bench.phases`.

One rollout on the shipped server (`sparring serve` with the code pack and its defaults, as
`bench/warm.py` starts it) calls, one call at a time after `--pause` (a model's turn):

- `run_python` of a script that reads the clock at its first line and at its last;
- the `python` tool with a cell that reads the clock once.

The client, the server, the sandbox and the program read the same clock (`time.perf_counter`,
CLOCK_MONOTONIC: the sandbox has no time namespace), so each call splits into the way in (the request,
the server's work before the program runs: the rollout's lock and state, the workspace sent, the run's
start or the interpreter's wake-up), the program itself, and the way out (the program's exit, the
files read back, the call log's commit, the answer). Also reported: on how many calls the program ran
on the CPU the client's answer was read on (a wake-up across CPUs can cost more than the work on a
VM whose idle CPUs halt). Results go to bench/results/phases-<timestamp>.json (gitignored).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.code import percentile
from bench.warm import Served

# The program's own clock and CPU, read without importing anything but builtin modules.
CPU = 'int(open("/proc/thread-self/stat").read().rsplit(")", 1)[1].split()[36])'
SCRIPT = f"import time\nstart = time.perf_counter()\nprint(1)\nprint(start, time.perf_counter(), {CPU})\n"
CELL = f"import time\n(time.perf_counter(), {CPU})"
PHASES = ("in", "program", "out", "total")


def cpu_now() -> int:
    with open("/proc/thread-self/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[36])


def summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    result: dict[str, Any] = {"n": len(rows)}
    for phase in PHASES:
        values = [row[phase] for row in rows]
        result[phase] = {"p50_ms": percentile(values, 0.5) * 1000, "p90_ms": percentile(values, 0.9) * 1000}
    result["same_cpu_share"] = sum(row["same_cpu"] for row in rows) / len(rows)
    return result


def run_python(server: Served, trace: str) -> dict[str, float]:
    started = time.perf_counter()
    answer = server.call(trace, "run_python", {"path": "main.py"})
    ended = time.perf_counter()
    cpu = cpu_now()
    if not isinstance(answer, dict) or not str(answer.get("stdout", "")).startswith("1\n"):
        raise RuntimeError(f"run_python answered {answer!r}")
    first, last, program_cpu = str(answer["stdout"]).split("\n")[1].split()
    return split(started, float(first), float(last), ended, int(program_cpu) == cpu)


def cell(server: Served, trace: str) -> dict[str, float]:
    started = time.perf_counter()
    answer = server.call(trace, "python", {"code": CELL})
    ended = time.perf_counter()
    cpu = cpu_now()
    if not isinstance(answer, dict) or not str(answer.get("value", "")).startswith("("):
        raise RuntimeError(f"python answered {answer!r}")
    stamp, program_cpu = str(answer["value"]).strip("()").split(",")
    return split(started, float(stamp), float(stamp), ended, int(program_cpu) == cpu)


def split(started: float, first: float, last: float, ended: float, same_cpu: bool) -> dict[str, float]:
    if not started <= first <= last <= ended:
        raise RuntimeError("the program's clock is not the client's: the phases cannot be told apart here")
    return {
        "in": first - started,
        "program": last - first,
        "out": ended - last,
        "total": ended - started,
        "same_cpu": float(same_cpu),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=150, help="calls of each kind")
    parser.add_argument("--pause", type=float, default=0.02, help="seconds before each call (a model's turn)")
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    rows: dict[str, list[dict[str, float]]] = {"run_python": [], "python_cell": []}
    with tempfile.TemporaryDirectory() as workdir:
        server = Served("warm", Path(workdir), {})
        try:
            health = server.wait_ready()["packs"]["code"]
            trace = f"bench-phases-{uuid.uuid4().hex[:8]}"
            server.call(trace, "write_file", {"path": "main.py", "content": SCRIPT})
            for _ in range(5):  # the page cache, the connection, the spare slot, the interpreter
                run_python(server, trace)
                cell(server, trace)
            for _ in range(args.calls):  # the two kinds take turns
                time.sleep(args.pause)
                rows["run_python"].append(run_python(server, trace))
                time.sleep(args.pause)
                rows["python_cell"].append(cell(server, trace))
        finally:
            server.stop()
    results = {name: summary(values) for name, values in rows.items()}
    for name, result in results.items():
        parts = "  ".join(f"{phase} {result[phase]['p50_ms']:5.2f}" for phase in PHASES)
        print(f"{name:12s} p50 ms: {parts}  (on the client's CPU: {result['same_cpu_share']:.0%})")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"phases-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {"results": results, "calls": args.calls, "pause_s": args.pause, "health": health}, indent=2
        )
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
