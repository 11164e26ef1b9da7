"""The rollout runner's own overhead: CPU per tool call of `sparring eval`'s loop against an instant target.

    .venv/bin/python -m bench.runner                       # 3 rounds of 400 rollouts, 200 at once
    .venv/bin/python -m bench.runner --policies scripted --rounds 1 --rollouts 50 --concurrency 50

The target (`bench/runner_target.py`, a uvicorn subprocess on a free loopback port) answers tool calls,
grades and model turns at once, so what the runner process spends is the runner's own cost: the loop,
the envelope, httpx, the grader call and, for the `responses` and `chat` policies, the `openai` SDK.
Each rollout makes `--turns` turns of `--calls` parallel calls, answers, and is graded. The figure is
the runner process's CPU time (user + system, `getrusage`) per tool call, with the target's CPU from
/proc beside it; results go to `bench/results/runner-<timestamp>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import resource
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.cpu import _proc_cpu
from bench.run import ROOT, Server, clean_env
from sparring.evaluate import FinishedRollout, Job, plan_jobs, run_jobs
from sparring.http import AiohttpTransport, HttpGrader, HttpToolCaller, Retry
from sparring.loop import DatasetLine, EpisodeLimits, FunctionCall, ModelTurn, Policy, Transcript
from sparring.policies import ChatPolicy, ResponsesPolicy, model_client
from sparring.session import server_target

POLICIES = ("scripted", "responses", "chat")


class InstantScript:
    """A model that answers at once, in process: `calls` parallel lookups per turn for `turns` turns."""

    def __init__(self, turns: int, calls: int) -> None:
        self.turns = turns
        self.calls = calls

    async def next_turn(self, transcript: Transcript) -> ModelTurn:
        step = len(transcript.steps)
        if step >= self.turns:
            return ModelTurn(text="done")
        return ModelTurn(
            calls=tuple(
                FunctionCall(
                    call_id=f"call_{step}_{i}", name="lookup", arguments=f'{{"key": {step * self.calls + i}}}'
                )
                for i in range(self.calls)
            )
        )


def dataset(rollouts: int) -> list[DatasetLine]:
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up.",
            "parameters": {"type": "object", "properties": {"key": {"type": "integer"}}, "required": ["key"]},
        },
    }
    return [
        DatasetLine.from_json(
            {
                "messages": [
                    {"role": "developer", "content": "Look things up."},
                    {"role": "user", "content": f"item {i}"},
                ],
                "tools": [tool],
                "id": f"item-{i}",
            }
        )
        for i in range(rollouts)
    ]


def process_cpu(pid: int) -> float:
    return _proc_cpu(Path(f"/proc/{pid}/stat").read_text())[1]


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def one_round(policy_name: str, url: str, args: argparse.Namespace, target_pid: int) -> dict[str, Any]:
    lines = dataset(args.rollouts)
    target = server_target(url, tools_key=None, grader_key=None, grader="bench")
    records: list[FinishedRollout] = []
    async with AiohttpTransport.open(args.concurrency) as client:
        model = model_client("bench", f"{url}/v1")
        policy: Policy
        if policy_name == "scripted":
            policy = InstantScript(args.turns, args.calls)
        elif policy_name == "responses":
            policy = ResponsesPolicy(model, "bench")
        else:
            policy = ChatPolicy(model, "bench")
        tools = HttpToolCaller(client, target.tools, run="bench", retry=Retry(attempts=3, delay_s=0.1))
        grader = HttpGrader(client, target.grader, run="bench", retry=Retry(attempts=3, delay_s=0.1))
        jobs: list[Job] = plan_jobs(lines, 1)
        # Warm the connections and the code paths, unmeasured.
        await run_jobs(jobs[: min(10, len(jobs))], lambda job: policy, tools, grader, limits=EpisodeLimits(),
                       concurrency=10, on_record=lambda r: None)  # fmt: skip
        cpu_before, target_before, started = own_cpu(), process_cpu(target_pid), time.perf_counter()
        await run_jobs(
            jobs,
            lambda job: policy,
            tools,
            grader,
            limits=EpisodeLimits(max_turns=args.turns + 1, max_tool_calls=args.turns * args.calls),
            concurrency=args.concurrency,
            on_record=records.append,
        )
        wall = time.perf_counter() - started
        cpu, target_cpu = own_cpu() - cpu_before, process_cpu(target_pid) - target_before
        await model.close()
    calls = sum(r.calls for r in records)
    graded = sum(1 for r in records if r.graded)
    return {
        "policy": policy_name,
        "rollouts": len(records),
        "graded": graded,
        "discarded": len(records) - graded,
        "tool_calls": calls,
        "wall_s": wall,
        "calls_per_s": calls / wall if wall else 0.0,
        "runner_cpu_s": cpu,
        "runner_cpu_ms_per_call": 1000 * cpu / calls if calls else None,
        "target_cpu_ms_per_call": 1000 * target_cpu / calls if calls else None,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="scripted, responses, chat (comma-separated)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=400, help="rollouts per round")
    parser.add_argument("--concurrency", type=int, default=200, help="rollouts in flight at once")
    parser.add_argument("--turns", type=int, default=5, help="turns with calls per rollout")
    parser.add_argument("--calls", type=int, default=2, help="parallel calls per turn")
    parser.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies: {', '.join(sorted(unknown))}")
    if not (1 <= args.rollouts <= 10_000 and 1 <= args.concurrency <= 1000 and 1 <= args.rounds <= 20):
        parser.error("keep --rollouts in 1..10000, --concurrency in 1..1000, --rounds in 1..20")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    env = clean_env()
    env.update({"RUNNER_BENCH_TURNS": str(args.turns), "RUNNER_BENCH_CALLS": str(args.calls)})
    server = Server("runner-target", "bench.runner_target:app", env, args.results_dir / "runner-target.log")
    server.start()
    runs: list[dict[str, Any]] = []
    try:
        server.wait_ready()
        for round_ in range(args.rounds):
            for policy in args.policies.split(","):
                result = asyncio.run(one_round(policy, server.url, args, server.pid))
                result["round"] = round_ + 1
                runs.append(result)
                print(
                    f"round {round_ + 1} {policy:<9} {result['tool_calls']} calls in {result['wall_s']:.2f} s"
                    f" ({result['calls_per_s']:.0f}/s),"
                    f" runner {result['runner_cpu_ms_per_call']:.3f} ms CPU per call,"
                    f" target {result['target_cpu_ms_per_call']:.3f} ms, discarded {result['discarded']}",
                    flush=True,
                )
    finally:
        server.stop()
    summary = []
    for policy in args.policies.split(","):
        mine = [r for r in runs if r["policy"] == policy]
        summary.append(
            {
                "policy": policy,
                "calls_per_s": statistics.median(r["calls_per_s"] for r in mine),
                "runner_cpu_ms_per_call": statistics.median(r["runner_cpu_ms_per_call"] for r in mine),
                "target_cpu_ms_per_call": statistics.median(r["target_cpu_ms_per_call"] for r in mine),
                "discarded": sum(r["discarded"] for r in mine),
            }
        )
    print(f"\nmedians over {args.rounds} round(s); {args.rollouts} rollouts, {args.concurrency} at once, "
          f"{args.turns} turns x {args.calls} calls")  # fmt: skip
    print(f"{'policy':<10} {'calls/s':>8} {'runner ms CPU/call':>19} {'target ms CPU/call':>19}")
    for row in summary:
        print(
            f"{row['policy']:<10} {row['calls_per_s']:>8.0f} {row['runner_cpu_ms_per_call']:>19.3f}"
            f" {row['target_cpu_ms_per_call']:>19.3f}"
        )
    out = args.results_dir / f"runner-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    config = {k: str(v) for k, v in vars(args).items()}
    machine = {"python": sys.version.split()[0], "platform": platform.platform()}
    out.write_text(
        json.dumps({"config": config, "machine": machine, "runs": runs, "summary": summary}, indent=2)
    )
    print(f"results: {out}")
    return 0 if all(row["discarded"] == 0 for row in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
