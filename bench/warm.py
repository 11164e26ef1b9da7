"""Warm, forked sandboxes against cold ones and bare Python: `python -m bench.warm`.

Measures, in the same run and interleaved (the machine is shared and noisy: the ratios are the result):

- `run_python` of a one-line script (`print(1)`) end to end over HTTP on the shipped server
  (`sparring serve` with the code pack and its defaults: one worker, warm parent), one call at a time
  on a kept-alive connection, against a bare `python3 -S -c pass` start of the sandbox's interpreter,
  with `--pause` (20 ms, a model's turn) between any two measurements, so what one leaves running (a
  warm slot preparing its next run, a cold sandbox's teardown) is not measured in the next; the same
  through a second server with `SPARRING_CODE_WARM=false` (the cold path) for comparison;
- the `python` tool: a trivial cell (`x += 1; x`) in a rollout's live interpreter, over HTTP on the same
  server, against the same bare start;
- `run_python`'s sandbox layer alone (no HTTP, no tool: `Sandbox.run` on the warm path), against the
  same bare start;
- the `code` grader's hidden tests of HumanEval's canonical solutions, `--concurrency` at once, through
  the sandbox's warm path and its cold path, against the same checks (the prompt, the canonical
  solution, the tests and `check(entry_point)`) run as plain unsandboxed `python3 -c` subprocesses; the
  three take turns on batches of `--batch` tasks, and each round's rate is its tasks over the time
  spent on each.

Results go to bench/results/warm-<timestamp>.json (gitignored).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.code import HOME, percentile
from bench.run import LOOPBACK, free_port
from tools.code import check
from tools.code.runtime import RUN_LIMITS, CodeSettings, build_sandbox, read_tasks
from tools.code.sandbox import Sandbox, probe
from tools.code.tasks import CodeTask
from tools.code.warm import WarmRunner

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-warm-key"


def ms(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": percentile(values, 0.5) * 1000,
        "p99_ms": percentile(values, 0.99) * 1000,
        "mean_ms": statistics.fmean(values) * 1000,
    }


class Served:
    """`sparring serve` with the code pack, as the README starts it; `extra` adds settings."""

    def __init__(self, name: str, workdir: Path, extra: dict[str, str]) -> None:
        self.name = name
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARRING_")}
        env.update(
            {
                "SPARRING_API_KEYS": f"tools:{KEY}",
                "SPARRING_PACKS": "code",
                "SPARRING_CODE_DATA": str(check_data()),
                "SPARRING_HOME": str(workdir / f"home-{name}"),
                "SPARRING_PORT": str(self.port),
                "PYTHONPATH": str(ROOT),
                **extra,
            }
        )
        self.log = workdir / f"{name}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [str(Path(sys.executable).parent / "sparring"), "serve", "--migrate"],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.connection: http.client.HTTPConnection | None = None
        self.calls = 0

    def wait_ready(self, timeout: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start-up:\n{self.log.read_text()[-3000:]}")
            try:
                status, body = self.request("GET", "/healthz", None)
                if status == 200:
                    return dict(json.loads(body))
            except OSError:
                self.connection = None
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready:\n{self.log.read_text()[-3000:]}")

    def request(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, bytes]:
        if self.connection is None:
            self.connection = http.client.HTTPConnection(LOOPBACK, self.port, timeout=60)
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        self.connection.request(method, path, json.dumps(body) if body is not None else None, headers)
        response = self.connection.getresponse()
        return response.status, response.read()

    def call(self, trace: str, name: str, arguments: dict[str, Any]) -> dict[str, Any] | str:
        self.calls += 1
        body = {
            "type": "function_call",
            "call_id": f"c{self.calls}-{uuid.uuid4().hex[:8]}",
            "name": name,
            "arguments": json.dumps(arguments),
            "trace_id": trace,
            "item": {},
        }
        status, raw = self.request("POST", f"/tools/{name}", body)
        if status != 200:
            raise RuntimeError(f"{name}: HTTP {status}: {raw[:300]!r}")
        output = json.loads(raw)["output"]
        try:
            return dict(json.loads(output))
        except ValueError:
            return str(output)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def check_data() -> Path:
    from tools.code import data

    return data.DATA.fetch(data.DATA.cache_dir(HOME))


def bare_start(python: str) -> float:
    started = time.perf_counter()
    subprocess.run([python, "-S", "-c", "pass"], check=True)
    return time.perf_counter() - started


def measure_http(args: argparse.Namespace, python: str, workdir: Path) -> dict[str, Any]:
    servers = {
        "warm": Served("warm", workdir, {}),
        "cold": Served("cold", workdir, {"SPARRING_CODE_WARM": "false"}),
    }
    try:
        health = {name: server.wait_ready()["packs"]["code"] for name, server in servers.items()}
        traces = {}
        for name, server in servers.items():
            traces[name] = f"bench-{name}-{uuid.uuid4().hex[:8]}"
            server.call(traces[name], "write_file", {"path": "main.py", "content": "print(1)\n"})
            for _ in range(5):  # the page cache, the connection
                server.call(traces[name], "run_python", {"path": "main.py"})
        cells = f"bench-cells-{uuid.uuid4().hex[:8]}"  # a rollout of the `python` tool, its interpreter live
        servers["warm"].call(cells, "python", {"code": "x = 0"})
        times: dict[str, list[float]] = {
            "warm": [],
            "cold": [],
            "bare": [],
            "list_files": [],
            "write_file": [],
            "python_cell": [],
        }
        warm_server = servers["warm"]

        def timed(name: str, server: Served, trace: str, tool: str, arguments: dict[str, Any]) -> Any:
            """One call, after a pause (a model's turn), its time kept under `name`; answers its output."""
            time.sleep(args.pause)
            started = time.perf_counter()
            answer = server.call(trace, tool, arguments)
            times[name].append(time.perf_counter() - started)
            return answer

        for index in range(args.calls):  # interleaved: all see the same neighbours
            for name, server in servers.items():
                if name == "cold" and index % args.cold_every:
                    continue
                answer = timed(name, server, traces[name], "run_python", {"path": "main.py"})
                if not isinstance(answer, dict) or answer.get("stdout") != "1\n":
                    raise RuntimeError(f"run_python answered {answer!r}")
            time.sleep(args.pause)
            times["bare"].append(bare_start(python))
            # The floors under run_python on the same server: HTTP and a reading tool; HTTP and a writing
            # tool (the rollout's lock, its state and the durable call log), no sandbox.
            timed("list_files", warm_server, traces["warm"], "list_files", {})
            timed(
                "write_file",
                warm_server,
                traces["warm"],
                "write_file",
                {"path": "note.txt", "content": str(index)},
            )
            # The `python` tool: a trivial cell in the rollout's live interpreter.
            cell = timed("python_cell", warm_server, cells, "python", {"code": "x += 1\nx"})
            if not isinstance(cell, dict) or cell.get("value") != str(index + 1):
                raise RuntimeError(f"python answered {cell!r}")
    finally:
        for server in servers.values():
            server.stop()
    summary = {name: ms(values) for name, values in times.items()}
    bare = summary["bare"]["p50_ms"]
    return {
        "health": health,
        **summary,
        "warm_to_bare_p50": summary["warm"]["p50_ms"] / bare,
        "cold_to_bare_p50": summary["cold"]["p50_ms"] / bare,
        "write_file_to_bare_p50": summary["write_file"]["p50_ms"] / bare,
        "python_cell_to_bare_p50": summary["python_cell"]["p50_ms"] / bare,
    }


async def plain_check(python: str, task: CodeTask) -> None:
    program = f"{task.prompt}{task.canonical_solution}\n\n{task.test}\n\ncheck({task.entry_point})\n"
    process = await asyncio.create_subprocess_exec(
        python, "-c", program, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    if await process.wait() != 0:
        raise RuntimeError(f"the plain check of {task.task_id} failed")


async def sandboxed_check(sandbox: Sandbox, task: CodeTask) -> None:
    files = {**task.starting_files(), "solution.py": task.gold_solution}
    passed, result = await check.run_hidden_tests(sandbox, task, files)
    if not passed:
        raise RuntimeError(
            f"the canonical solution of {task.task_id} did not pass: {result.stderr.data[-300:]!r}"
        )


async def sandboxed_trivial(sandbox: Sandbox) -> None:
    """`run_python` of `print(1)` at the sandbox layer: the workspace in, the run, the files back."""
    result = await sandbox.run(
        {"main.py": "print(1)\n"},
        ["-E", "-s", "-B", "-X", "utf8", "main.py"],
        limits=RUN_LIMITS,
        collect=True,
    )
    if result.stdout.data != b"1\n":
        raise RuntimeError(f"the run answered {result!r}")


async def bare_start_async(python: str) -> None:
    process = await asyncio.create_subprocess_exec(python, "-S", "-c", "pass")
    if await process.wait() != 0:
        raise RuntimeError("python -S -c pass failed")


async def rate(kind: str, work: Any, tasks: list[CodeTask], concurrency: int) -> float:
    semaphore = asyncio.Semaphore(concurrency)

    async def one(task: CodeTask) -> None:
        async with semaphore:
            await work(task)

    started = time.perf_counter()
    await asyncio.gather(*(one(task) for task in tasks))
    return len(tasks) / (time.perf_counter() - started)


async def measure_grades(args: argparse.Namespace) -> dict[str, Any]:
    settings = CodeSettings()
    tasks = list(read_tasks(settings, HOME).values())[: args.grades]
    sandbox = build_sandbox(settings, home=HOME, binds_loopback=True)
    await probe(sandbox)
    runner = WarmRunner(sandbox, settings.warm_runs)
    if not await runner.start():
        raise RuntimeError(f"the warm path cannot run here: {runner.why_cold}")
    python = str(sandbox.python)
    for _ in range(3):
        await sandboxed_trivial(sandbox)
    sandbox.warm = runner
    layer: dict[str, list[float]] = {"warm_run": [], "bare": []}
    for _ in range(args.calls):  # the sandbox layer alone (no HTTP, no tool), interleaved with bare starts
        await asyncio.sleep(args.pause)
        started = time.perf_counter()
        await sandboxed_trivial(sandbox)
        layer["warm_run"].append(time.perf_counter() - started)
        await asyncio.sleep(args.pause)
        started = time.perf_counter()
        await bare_start_async(python)
        layer["bare"].append(time.perf_counter() - started)
    rounds: dict[str, list[float]] = {"warm": [], "cold": [], "plain": []}
    kinds = {
        "warm": lambda t: sandboxed_check(sandbox, t),
        "cold": lambda t: sandboxed_check(sandbox, t),
        "plain": lambda t: plain_check(python, t),
    }
    try:
        for _ in range(args.rounds):
            # The three take turns on small batches (`--batch` tasks each), so a neighbour's burst of load
            # falls on all of them alike; a round's rate is its tasks over the time spent on each kind.
            spent = dict.fromkeys(kinds, 0.0)
            for start in range(0, len(tasks), args.batch):
                batch = tasks[start : start + args.batch]
                for kind, work in kinds.items():
                    sandbox.warm = runner if kind == "warm" else None
                    started = time.perf_counter()
                    await rate(kind, work, batch, args.concurrency)
                    spent[kind] += time.perf_counter() - started
            for kind in kinds:
                rounds[kind].append(len(tasks) / spent[kind])
    finally:
        sandbox.warm = None
        await runner.close()
        sandbox.close()
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    layer_summary = {name: ms(values) for name, values in layer.items()}
    return {
        "sandbox_layer": {
            **layer_summary,
            "warm_run_to_bare_p50": layer_summary["warm_run"]["p50_ms"] / layer_summary["bare"]["p50_ms"],
        },
        "tasks": len(tasks),
        "concurrency": args.concurrency,
        "rounds_per_s": rounds,
        "per_s": medians,
        "warm_to_plain": [w / p for w, p in zip(rounds["warm"], rounds["plain"], strict=True)],
        "cold_to_plain": [c / p for c, p in zip(rounds["cold"], rounds["plain"], strict=True)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=200, help="run_python calls on the warm server")
    parser.add_argument("--cold-every", type=int, default=2, help="a cold server call every N warm ones")
    parser.add_argument(
        "--pause",
        type=float,
        default=0.02,
        help="seconds between two measurements (a model's turn), so one's aftermath is not in the next",
    )
    parser.add_argument("--grades", type=int, default=164, help="canonical solutions per round (up to 164)")
    parser.add_argument("--rounds", type=int, default=3, help="grader rounds (warm, cold, plain each)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--batch", type=int, default=12, help="grades of one kind before the next kind's")
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--skip-grades", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    python = str(build_sandbox(CodeSettings(), home=HOME, binds_loopback=True).python)
    results: dict[str, Any] = {"at": datetime.now(UTC).isoformat(timespec="seconds"), "python": python}
    if not args.skip_http:
        with tempfile.TemporaryDirectory(prefix="bench-warm-") as workdir:
            http_results = measure_http(args, python, Path(workdir))
        results["run_python_http"] = http_results
        for name in ("warm", "cold", "bare", "list_files", "write_file", "python_cell"):
            row = http_results[name]
            print(f"{name:11} p50 {row['p50_ms']:6.2f} ms  p99 {row['p99_ms']:6.2f} ms  (n={row['n']})")
        print(
            "run_python over HTTP / bare python3 -S start at p50: "
            f"warm {http_results['warm_to_bare_p50']:.2f}, cold {http_results['cold_to_bare_p50']:.2f} "
            f"(write_file, no sandbox: {http_results['write_file_to_bare_p50']:.2f}); the python tool's "
            f"trivial cell: {http_results['python_cell_to_bare_p50']:.2f}"
        )
    if not args.skip_grades:
        grades = asyncio.run(measure_grades(args))
        results["grades"] = grades
        layer = grades["sandbox_layer"]
        print(
            f"sandbox layer (no HTTP): warm run p50 {layer['warm_run']['p50_ms']:.2f} ms, bare "
            f"{layer['bare']['p50_ms']:.2f} ms: {layer['warm_run_to_bare_p50']:.2f}"
        )
        per_s = grades["per_s"]
        print(
            f"code grader, {grades['tasks']} canonical solutions, {grades['concurrency']} at once: "
            f"warm {per_s['warm']:.1f}/s, cold {per_s['cold']:.1f}/s, plain python3 -c {per_s['plain']:.1f}/s"
        )
        print(
            "warm / plain per round: "
            + ", ".join(f"{r:.2f}" for r in grades["warm_to_plain"])
            + "; cold / plain: "
            + ", ".join(f"{r:.2f}" for r in grades["cold_to_plain"])
        )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"warm-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
