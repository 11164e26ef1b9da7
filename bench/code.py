"""The code pack's sandbox and grader: `python -m bench.code`.

Measures, in the same run and interleaved (the machine is shared and noisy):

- `run_python` of a trivial file through the bwrap sandbox exactly as the tool runs it (materialize the
  workspace, bwrap with every namespace and limit, the interpreter, read the files back), against a bare
  `python -c pass` subprocess of the same interpreter: p50/p99 latency and the overhead at p50;
- executions per second of both with `--concurrency` at once;
- grades per second of the `code` grader (hidden tests of canonical solutions), and their p50/p99.

Results go to bench/results/code-<timestamp>.json (gitignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tools.code import check, tools
from tools.code.runtime import CodeSettings, build_sandbox, read_tasks
from tools.code.sandbox import Sandbox
from tools.code.tasks import CodeTask

HOME = Path(".sparring")
TRIVIAL = {"main.py": "pass\n", "solution.py": "def f():\n    return 1\n"}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": percentile(values, 0.5) * 1000,
        "p99_ms": percentile(values, 0.99) * 1000,
        "mean_ms": statistics.fmean(values) * 1000,
    }


async def bare_python(python: str) -> None:
    process = await asyncio.create_subprocess_exec(
        python, "-c", "pass", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    if await process.wait() != 0:
        raise RuntimeError("python -c pass failed")


async def sandboxed_run(sandbox: Sandbox) -> None:
    result = await sandbox.run(
        TRIVIAL, ["-E", "-s", "-B", "-X", "utf8", "main.py"], limits=tools.RUN_LIMITS, collect=True
    )
    if result.exit_code != 0:
        raise RuntimeError(f"sandboxed run failed: {result.stderr.data[-300:]!r}")


async def timed(fn: Callable[[], Awaitable[None]]) -> float:
    started = time.perf_counter()
    await fn()
    return time.perf_counter() - started


async def throughput(fn: Callable[[], Awaitable[None]], count: int, concurrency: int) -> float:
    semaphore = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with semaphore:
            await fn()

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    return count / (time.perf_counter() - started)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    # The tasks and the sandbox the code pack would have from SPARRING_CODE_* (a server's pack owns its own).
    settings = CodeSettings()
    tasks = list(read_tasks(settings, HOME).values())[: args.grades]
    sandbox = build_sandbox(settings, home=HOME, binds_loopback=True)
    try:
        return await measure_with(sandbox, tasks, args)
    finally:
        sandbox.close()


async def measure_with(sandbox: Sandbox, tasks: list[CodeTask], args: argparse.Namespace) -> dict[str, Any]:
    python = str(sandbox.python)
    for _ in range(3):  # warm the page cache
        await sandboxed_run(sandbox)
        await bare_python(python)
    sandboxed: list[float] = []
    bare: list[float] = []
    for _ in range(args.runs):  # interleaved: both see the same neighbours
        sandboxed.append(await timed(lambda: sandboxed_run(sandbox)))
        bare.append(await timed(lambda: bare_python(python)))
    rates = {
        "sandboxed_per_s": await throughput(lambda: sandboxed_run(sandbox), args.runs, args.concurrency),
        "bare_per_s": await throughput(lambda: bare_python(python), args.runs, args.concurrency),
    }
    grade_times: list[float] = []
    semaphore = asyncio.Semaphore(args.concurrency)

    async def grade(index: int) -> None:
        task = tasks[index % len(tasks)]
        files = {**task.starting_files(), "solution.py": task.gold_solution}
        async with semaphore:
            started = time.perf_counter()
            passed, _ = await check.run_hidden_tests(sandbox, task, files)
            grade_times.append(time.perf_counter() - started)
        if not passed:
            raise RuntimeError(f"the canonical solution of {task.task_id} did not pass")

    started = time.perf_counter()
    await asyncio.gather(*(grade(i) for i in range(len(tasks))))
    grades_per_s = len(tasks) / (time.perf_counter() - started)
    run_python, baseline = summary(sandboxed), summary(bare)
    return {
        "sandbox": sandbox.mode,
        "python": python,
        "run_python": run_python,
        "bare_python": baseline,
        "overhead_p50_ms": run_python["p50_ms"] - baseline["p50_ms"],
        "concurrency": args.concurrency,
        **rates,
        "grades": {"count": len(tasks), "per_s": grades_per_s, **summary(grade_times)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=200, help="sandboxed runs (and as many bare ones)")
    parser.add_argument("--grades", type=int, default=164, help="canonical solutions to grade (up to 164)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args))
    results["at"] = datetime.now(UTC).isoformat(timespec="seconds")
    run, bare, grades = results["run_python"], results["bare_python"], results["grades"]
    print(f"run_python (bwrap)  p50 {run['p50_ms']:.1f} ms  p99 {run['p99_ms']:.1f} ms  (n={run['n']})")
    print(f"python -c pass      p50 {bare['p50_ms']:.1f} ms  p99 {bare['p99_ms']:.1f} ms")
    print(f"sandbox overhead at p50: {results['overhead_p50_ms']:.1f} ms")
    print(
        f"executions/s at concurrency {args.concurrency}: sandboxed {results['sandboxed_per_s']:.1f}, "
        f"bare {results['bare_per_s']:.1f}"
    )
    print(
        f"code grader: {grades['per_s']:.2f} grades/s ({grades['count']} canonical solutions), "
        f"p50 {grades['p50_ms']:.0f} ms, p99 {grades['p99_ms']:.0f} ms"
    )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"code-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
