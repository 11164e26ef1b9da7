"""The code pack's persistent interpreter (the `python` tool): `python -m bench.interpreter`.

Measures, in the same run and interleaved (the machine is shared and noisy):

- a trivial cell (`x += 1; x`) in a live interpreter through the tool's own path (`InterpreterPool`:
  the workspace sync, the frames, the workspace read back), against a bare `python -c pass` start of the
  same interpreter: p50/p99 and their ratio;
- the start of a new interpreter (bwrap, the driver, its first frame);
- the resident memory of a live interpreter (its whole process tree: bwrap, the sandbox's init, the
  driver) with `--live` interpreters started at once;
- a new rollout's first call (its interpreter and a cell), rollouts arriving `--arrival` seconds apart:
  from a pool with spares (`SPARRING_CODE_INTERPRETER_SPARES`, 2 by default) against one without,
  taking turns.

Results go to bench/results/interpreter-<timestamp>.json (gitignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import replace
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
    # The measures above start their interpreters themselves: no spares.
    pool = InterpreterPool(sandbox, replace(settings.interpreter_limits(), spares=0))
    try:
        results = await measure_with(pool, args)
    finally:
        await pool.close()
    try:
        if args.first:
            results["first_call"] = await measure_first_calls(sandbox, settings, args)
    finally:
        sandbox.close()
    return results


async def measure_first_calls(
    sandbox: Any, settings: CodeSettings, args: argparse.Namespace
) -> dict[str, Any]:
    """A new rollout's first call through the pool: its interpreter (a spare, or started now) and a
    trivial first cell; each kind in turn, a rollout every `--arrival` seconds."""
    limits = settings.interpreter_limits()
    pools = {
        "spares": InterpreterPool(sandbox, replace(limits, spares=max(1, limits.spares))),
        "no_spares": InterpreterPool(sandbox, replace(limits, spares=0)),
    }
    times: dict[str, list[float]] = {name: [] for name in pools}
    for pool in pools.values():
        pool.start()
    try:
        for index in range(args.first):
            for name, pool in pools.items():
                await asyncio.sleep(args.arrival)
                trace = f"first-{name}-{index}"
                started = time.perf_counter()
                async with pool.use(trace, None) as (interpreter, _):
                    result = await interpreter.cell("x = 1\nx", interpreter.changes(FILES), pool.limits)
                times[name].append(time.perf_counter() - started)
                if result.value != "1":
                    raise RuntimeError(f"a first cell answered {result!r}")
                await pool.discard(trace, "")
    finally:
        for pool in pools.values():
            await pool.close()
    spares, cold = summary(times["spares"]), summary(times["no_spares"])
    return {
        "arrival_s": args.arrival,
        "spares": pools["spares"].limits.spares,
        "with_spares": spares,
        "without_spares": cold,
        "with_to_without_p50": spares["p50_ms"] / cold["p50_ms"],
    }


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
    parser.add_argument("--first", type=int, default=20, help="new rollouts' first calls of each kind")
    parser.add_argument("--arrival", type=float, default=0.5, help="seconds between two new rollouts")
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
    if results.get("first_call"):
        first = results["first_call"]
        with_, without = first["with_spares"], first["without_spares"]
        print(
            f"a new rollout's first call, one every {first['arrival_s']:g} s: with {first['spares']} spares "
            f"p50 {with_['p50_ms']:.1f} ms, without p50 {without['p50_ms']:.1f} ms "
            f"({first['with_to_without_p50']:.3f})"
        )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"interpreter-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
