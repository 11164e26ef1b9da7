"""The code pack's persistent interpreter (the `python` tool): `python -m bench.interpreter`.

Measures, in the same run and interleaved (the machine is shared and noisy):

- a trivial cell (`x += 1; x`) in a live interpreter through the tool's own path (`InterpreterPool`:
  the workspace sync, the frames, the workspace read back), against a bare `python -c pass` start of the
  same interpreter: p50/p99 and their ratio;
- the start of a new interpreter (bwrap, the driver, its first frame);
- the resident memory of a live interpreter (its whole process tree: bwrap, the sandbox's init, the
  driver) with `--live` interpreters started at once.

Results go to bench/results/interpreter-<timestamp>.json (gitignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.code import HOME, bare_python, summary
from tools.code.interpreter import InterpreterPool
from tools.code.runtime import CodeSettings, build_sandbox

FILES = {"solution.py": "def f():\n    return 1\n"}


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and all its descendants (0 for those already gone)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
        pending += [int(child) for child in children]
    return total


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    settings = CodeSettings(interpreter_max=max(args.live, 1))
    sandbox = build_sandbox(settings, home=HOME, binds_loopback=True)
    pool = InterpreterPool(sandbox, settings.interpreter_limits())
    try:
        return await measure_with(pool, args)
    finally:
        await pool.close()
        sandbox.close()


async def measure_with(pool: InterpreterPool, args: argparse.Namespace) -> dict[str, Any]:
    python = str(pool.sandbox.python)
    cells: list[float] = []
    bare: list[float] = []
    starts: list[float] = []
    async with pool.use("bench", None) as (interpreter, _):
        await interpreter.cell("x = 0", interpreter.changes(FILES), pool.limits)
        interpreter.known = dict(FILES)
        for _ in range(args.cells):  # interleaved: both see the same neighbours
            started = time.perf_counter()
            result = await interpreter.cell("x += 1\nx", interpreter.changes(FILES), pool.limits)
            cells.append(time.perf_counter() - started)
            started = time.perf_counter()
            await bare_python(python)
            bare.append(time.perf_counter() - started)
        if result.value != str(args.cells):
            raise RuntimeError(f"the interpreter's state was lost: {result.value!r}")
    rss: list[int] = []
    for index in range(args.live):
        started = time.perf_counter()
        async with pool.use(f"live-{index}", None) as (interpreter, _):
            await interpreter.cell("import json, re, collections", {}, pool.limits)
        starts.append(time.perf_counter() - started)
    for interpreter in pool.live.values():
        rss.append(tree_rss_bytes(interpreter.session.process.pid))
    cell, baseline = summary(cells), summary(bare)
    return {
        "sandbox": pool.sandbox.mode,
        "python": python,
        "cell": cell,
        "bare_python": baseline,
        "cell_to_bare_p50": cell["p50_ms"] / baseline["p50_ms"],
        "start_and_first_cell": summary(starts) if starts else None,
        "live": len(rss),
        "rss_per_interpreter_mib": (sum(rss) / len(rss) / 2**20) if rss else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cells", type=int, default=300, help="trivial cells (and as many bare starts)")
    parser.add_argument("--live", type=int, default=20, help="interpreters started to measure memory")
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args))
    results["at"] = datetime.now(UTC).isoformat(timespec="seconds")
    cell, bare = results["cell"], results["bare_python"]
    print(f"python tool cell    p50 {cell['p50_ms']:.2f} ms  p99 {cell['p99_ms']:.2f} ms  (n={cell['n']})")
    print(f"python -c pass      p50 {bare['p50_ms']:.2f} ms  p99 {bare['p99_ms']:.2f} ms")
    print(f"cell / bare start at p50: {results['cell_to_bare_p50']:.3f}")
    if results["start_and_first_cell"]:
        start = results["start_and_first_cell"]
        print(f"new interpreter + first cell  p50 {start['p50_ms']:.0f} ms  p99 {start['p99_ms']:.0f} ms")
        print(f"resident memory per live interpreter: {results['rss_per_interpreter_mib']:.1f} MiB")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"interpreter-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
