"""Grades per second of POST /grade/{name}, against the bare echo app in the same run, with wrk.

    python -m bench.grading                      # 3 rounds of 10 s per grader
    python -m bench.grading --rounds 1 --duration 5

Three graders: `string` (a string_check), `fuzzy_multi` (a multi of a string_check and a fuzzy_match
text_similarity) and `trace_multi` (a multi that reads the rollout the server recorded: string_check,
tool_budget, no_loops and grounded). Before the load, each of `--rollouts` rollouts gets `--calls`
logged tool calls, so the trace-aware grader reads real rows; the requests cycle through them, each
with a new answer (bench/wrk/grade.lua), so repeated grades of one rollout rarely overlap and the
stored grades do not pile up on one answer hash. sparring runs on Postgres + Redis (a fresh database,
dropped at the end). Each grader run follows an echo run, and the ratio is taken pair by pair.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.run import (
    BENCH_DIR,
    DEFAULT_PG_ADMIN,
    DEFAULT_REDIS,
    Environment,
    Server,
    WrkResult,
    call_body,
    clean_env,
    finite,
    machine_info,
    median,
    run_wrk,
    wrk_script,
)

GRADE_SCRIPT = BENCH_DIR / "wrk" / "grade.lua"
STRING = {
    "type": "string_check",
    "name": "string",
    "operation": "eq",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.reference_answer }}",
}
GRADERS = {
    "string": STRING,
    "fuzzy_multi": {
        "type": "multi",
        "name": "fuzzy_multi",
        "graders": {
            "exact": STRING,
            "fuzzy": {
                "type": "text_similarity",
                "name": "fuzzy",
                "input": "{{ sample.output_text }}",
                "reference": "{{ item.reference_answer }}",
                "evaluation_metric": "fuzzy_match",
            },
        },
        "calculate_output": "0.5 * exact + 0.5 * fuzzy",
    },
    "trace_multi": {
        "type": "multi",
        "name": "trace_multi",
        "graders": {
            "exact": STRING,
            "budget": {"type": "tool_budget", "name": "budget", "max_calls": 4},
            "loops": {"type": "no_loops", "name": "loops"},
            "grounded": {"type": "grounded", "name": "grounded"},
        },
        "calculate_output": "exact * (0.5 + 0.2 * budget + 0.1 * loops + 0.2 * grounded)",
    },
}


def grade_wrk(
    wrk: str,
    url: str,
    grader: str,
    *,
    nonce: str,
    key: str,
    args: argparse.Namespace,
    pid: int,
    pg_database: str | None = None,
    tag: str = "r",
) -> WrkResult:
    return wrk_script(
        wrk,
        GRADE_SCRIPT,
        url,
        [nonce, grader, str(args.rollouts), key, tag],
        args,
        server_pid=pid,
        pg_database=pg_database,
    )


def seed(url: str, key: str, nonce: str, rollouts: int, calls: int) -> None:
    """Log `calls` echo calls (the last repeats an earlier one, so no_loops has work) per graded rollout,
    the rollouts in parallel (32 at a time), the calls of one rollout one after the other."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    async def one(client: httpx.AsyncClient, gate: asyncio.Semaphore, rollout: int) -> None:
        async with gate:
            for i in range(calls):
                body = json.loads(call_body(nonce, "echo", rollout + rollouts * i, rollouts))
                body["trace_id"] = f"trace_{nonce}_{rollout}"
                if i == calls - 1:
                    body["arguments"] = json.dumps({"text": "hello 0"})
                for _attempt in range(5):  # a 503 is retried with the same call_id, as trainers do
                    response = await client.post("/tools/echo", json=body)
                    if response.status_code != 503:
                        break
                    unavailable.append(response.text)
                    await asyncio.sleep(0.5)
                response.raise_for_status()

    async def all_rollouts() -> None:
        gate = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
            await asyncio.gather(*(one(client, gate, r) for r in range(rollouts)))

    unavailable: list[str] = []
    asyncio.run(all_rollouts())
    if unavailable:
        print(f"seeding: {len(unavailable)} answers 503 (retried), e.g. {unavailable[0][:300]}", flush=True)


def check_scores(url: str, key: str, nonce: str, graders: list[str], calls: int) -> dict[str, float]:
    """One grade per grader before the load, with the body grade.lua sends: the scores must be the
    expected ones (string checks pass; the trace-aware grader sees the seeded calls over its budget)."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    answer = "The total is 1,234.50 for order #W0 (ref check-0)"
    body = {
        "sample": {"output_text": answer, "choices": []},
        "item": {"id": "row_0", "reference_answer": answer},
        "trace_id": f"trace_{nonce}_0",
    }
    scores: dict[str, float] = {}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        for name in graders:
            response = client.post(f"/grade/{name}", json=body)
            if response.status_code != 200 or set(response.json()) != {"score"}:
                raise RuntimeError(f"/grade/{name}: {response.status_code} {response.text}")
            scores[name] = float(response.json()["score"])
    for name, score in scores.items():
        if name in ("string", "fuzzy_multi") and score != 1.0:
            raise RuntimeError(f"/grade/{name} scored {score}, expected 1.0")
        over_budget = calls > GRADERS["trace_multi"]["graders"]["budget"]["max_calls"]  # type: ignore[index]
        if name == "trace_multi" and not (0.0 < score < 1.0 if over_budget else 0.0 < score <= 1.0):
            raise RuntimeError(f"/grade/{name} scored {score}: the seeded calls were not seen")
    return scores


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rollouts", type=int, default=512, help="distinct seeded rollouts graded")
    parser.add_argument("--calls", type=int, default=6, help="tool calls logged per rollout before grading")
    parser.add_argument("--graders", default=",".join(GRADERS))
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--results-dir", type=Path, default=BENCH_DIR / "results")
    parser.add_argument(
        "--db-pool-size",
        type=int,
        default=None,
        help="SPARRING_DB_POOL_SIZE of the server (its default: unset)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wrk = "wrk"
    if subprocess.run(["which", wrk], capture_output=True, check=False).returncode != 0:
        print("wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    tools_key, grader_key = secrets.token_hex(16), secrets.token_hex(16)
    nonce = secrets.token_hex(4)
    started_at = datetime.now(UTC)
    env = Environment(
        Path(tempfile.mkdtemp(prefix="sparring-bench-grading-")), args.pg_admin_url, args.redis_url, False
    )
    env.create_postgres()
    graders_file = env.workdir / "graders.json"
    graders_file.write_text(json.dumps(GRADERS))
    logs = env.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    base = clean_env()
    echo = Server("echo", "bench.echo_app:app", dict(base), logs / "echo.log")
    sparring = Server(
        "sparring-pg",
        "app.main:create_app",
        {
            **base,
            "SPARRING_API_KEYS": f"tools:{tools_key},grader:{grader_key}",
            "SPARRING_PACKS": "bench.bench_pack",
            "SPARRING_HOME": str(env.workdir / "home"),
            "SPARRING_DATABASE_URL": env.database_url,
            "SPARRING_REDIS_URL": env.redis_url,
            "SPARRING_GRADERS_FILE": str(graders_file),
            **({"SPARRING_DB_POOL_SIZE": str(args.db_pool_size)} if args.db_pool_size else {}),
        },
        logs / "sparring.log",
        factory=True,
        ready_path="/readyz",
    )
    results: dict[str, list[tuple[WrkResult, WrkResult]]] = {name: [] for name in args.graders.split(",")}
    scores: dict[str, float] = {}
    info = machine_info()
    try:
        for server in (echo, sparring):
            server.start()
        for server in (echo, sparring):
            server.wait_ready()
        seed(sparring.url, tools_key, nonce, args.rollouts, args.calls)
        scores = check_scores(sparring.url, grader_key, nonce, list(results), args.calls)
        print(
            "scores of the graded body: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()), flush=True
        )
        for round_ in range(args.rounds):
            for name in results:
                baseline = run_wrk(
                    wrk,
                    echo.url,
                    nonce=f"e{round_}{name}",
                    tool="echo",
                    rollouts=args.rollouts,
                    key="",
                    args=args,
                )
                graded = grade_wrk(
                    wrk,
                    sparring.url,
                    name,
                    nonce=nonce,
                    key=grader_key,
                    args=args,
                    pid=sparring.pid,
                    pg_database=env.pg_database,
                    tag=f"{round_}{name}",
                )
                results[name].append((baseline, graded))
                ratio = graded.rps / baseline.rps
                print(
                    f"round {round_ + 1} {name:12s} {graded.rps:8.0f} grades/s  "
                    f"echo {baseline.rps:8.0f} req/s  ratio {ratio:.2f}  "
                    f"p50 {graded.p50_ms:.1f} ms  p99 {graded.p99_ms:.1f} ms  "
                    f"server {graded.cpu.get('server_pct', 0):.0f}% "
                    f"({graded.server_cpu_ms_per_call:.2f} ms/grade)  "
                    f"pg {graded.cpu.get('postgres_pct', 0):.0f}%  "
                    f"machine {graded.cpu.get('machine_busy_pct', 0):.0f}%  "
                    f"errors {graded.errors}",
                    flush=True,
                )
    finally:
        for server in (sparring, echo):
            server.stop()
        env.teardown()
    rows = []
    for name, pairs in results.items():
        rows.append(
            {
                "grader": name,
                "grades_per_s": median([g.rps for _, g in pairs]),
                "echo_rps": median([b.rps for b, _ in pairs]),
                "ratio_to_echo": median([g.rps / b.rps for b, g in pairs]),
                "p50_ms": median([g.p50_ms for _, g in pairs]),
                "p99_ms": median([g.p99_ms for _, g in pairs]),
                "server_cpu_ms_per_grade": median([g.server_cpu_ms_per_call for _, g in pairs]),
                "echo_cpu_ms_per_call": median([b.server_cpu_ms_per_call for b, _ in pairs]),
                "non_2xx_or_errors": sum(sum(g.errors.values()) for _, g in pairs),
                "score": scores.get(name),
            }
        )
    print(
        f"\n{args.rounds} rounds, {args.duration} s per wrk run, {args.connections} connections, "
        f"{args.rollouts} rollouts with {args.calls} logged calls each; medians; x echo pair by pair"
    )
    print("| grader | grades/s | echo req/s | × echo | p50 ms | p99 ms | server CPU ms/grade |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| `{row['grader']}` | {row['grades_per_s']:.0f} | {row['echo_rps']:.0f} | "
            f"{row['ratio_to_echo']:.2f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | "
            f"{row['server_cpu_ms_per_grade']:.2f} |"
        )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"grading-{started_at.strftime('%Y%m%d-%H%M%S')}.json"
    result: dict[str, Any] = {
        "started_at": started_at.isoformat(),
        "finished_at": datetime.now(UTC).isoformat(),
        "machine": info,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "graders": GRADERS,
        "summary": rows,
        "runs": {
            name: [{"echo": vars(b), "grade": vars(g)} for b, g in pairs] for name, pairs in results.items()
        },
    }
    out.write_text(json.dumps(finite(result), indent=2))
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
