"""The `code` grader on the agent's box: `python -m bench.box_grade`.

Measures, in the same run and interleaved (the machine is shared and noisy), one grade of a HumanEval
task's hidden tests against its canonical solution, two ways:

- `check_in: workspace`: the tests on a copy of the workspace in a fresh sandbox (`run_hidden_tests`:
  bwrap, the harness and the runner processes);
- `check_in: interpreter`, as the grader runs it for a row with an entry point: the tests in a judge (an
  interpreter no cell ran in: a spare, stopped after the grade) calling the solution in a fork of a live
  interpreter whose cells defined it (`InterpreterPool.judge` and `Interpreter.judged`: each call
  relayed by the server, the workspace copied and put back, the fork's leftovers stopped). The pool keeps
  its default spares, started in the background as the grader's pool does.

Both before HTTP and the grade's storage. Results go to bench/results/box-grade-<timestamp>.json
(gitignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.code import HOME, summary
from tools.code import data
from tools.code.check import GRADE_LIMITS, run_hidden_tests
from tools.code.interpreter import InterpreterPool
from tools.code.runtime import CodeSettings, build_sandbox
from tools.code.tasks import load_tasks

TASKS = ("HumanEval/0", "HumanEval/12", "HumanEval/32", "HumanEval/100")


async def measure(rounds: int) -> dict[str, dict[str, float]]:
    settings = CodeSettings()
    sandbox = build_sandbox(settings, home=HOME, binds_loopback=True)
    tasks = load_tasks(data.DATA.fetch(data.DATA.cache_dir(HOME)))
    pool = InterpreterPool(sandbox, settings.interpreter_limits())
    pool.start()  # its spares: a judge takes one, and another is started behind it
    workspace: list[float] = []
    interpreter: list[float] = []
    try:
        for task_id in TASKS:
            task = tasks[task_id]
            files = {"solution.py": task.gold_solution}
            job = {"test": task.test, "entry_point": task.entry_point, "prompt": task.prompt}
            async with pool.use(task_id, None) as (live, _):
                cell = await live.cell(task.gold_solution, live.changes(files), pool.limits)
                if cell.exception is not None:
                    raise RuntimeError(f"{task_id}: {cell.exception}")
                live.known = dict(files)
                for _ in range(rounds):
                    started = time.perf_counter()
                    passed, _result = await run_hidden_tests(sandbox, task, files)
                    workspace.append(time.perf_counter() - started)
                    await spares_ready(pool)  # as after a model's turn: the judge taken is replaced
                    started = time.perf_counter()
                    async with pool.judge() as judge:
                        verdict = await live.judged(judge, job, GRADE_LIMITS.wall_seconds, {})
                    interpreter.append(time.perf_counter() - started)
                    if not (passed and verdict.passed):
                        raise RuntimeError(f"{task_id}: a canonical solution failed ({verdict.error})")
    finally:
        await pool.close()
        sandbox.close()
    return {"workspace": summary(workspace), "interpreter": summary(interpreter)}


async def spares_ready(pool: InterpreterPool) -> None:
    for _ in range(400):
        if len(pool.spares) >= pool.limits.spares:
            return
        await asyncio.sleep(0.025)
    raise RuntimeError("the interpreter pool's spares did not start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25, help="grades of each kind per task")
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args.rounds))
    ratio = results["interpreter"]["p50_ms"] / results["workspace"]["p50_ms"]
    for name, numbers in results.items():
        print(f"{name:12} p50 {numbers['p50_ms']:8.1f} ms   p99 {numbers['p99_ms']:8.1f} ms")
    print(f"interpreter ÷ workspace at p50: {ratio:.3f}")
    out = Path("bench/results") / f"box-grade-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"rounds": args.rounds, "tasks": TASKS, **results, "ratio_p50": ratio}, indent=2)
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
