"""Grades per second of POST /grade/{name}, against the bare echo app in the same run, with wrk.

    python -m bench.grading                      # 3 rounds of 10 s per grader
    python -m bench.grading --rounds 1 --duration 5

Three graders: `string` (a string_check), `fuzzy_multi` (a multi of a string_check and a fuzzy_match
text_similarity) and `trace_multi` (a multi that reads the rollout the server recorded: string_check,
tool_budget, no_loops and grounded). Before the load, every rollout gets `--calls` logged tool calls,
so the trace-aware grader reads real rows. sparring runs on Postgres + Redis (a fresh database,
dropped at the end). Each grader run follows an echo run, and the ratio is taken pair by pair.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.cpu import snapshot, usage
from bench.run import (
    _BENCH_LINE,
    BENCH_DIR,
    DEFAULT_PG_ADMIN,
    DEFAULT_REDIS,
    Environment,
    Server,
    WrkResult,
    call_body,
    clean_env,
    median,
    run_wrk,
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
    wrk: str, url: str, grader: str, *, nonce: str, key: str, args: argparse.Namespace, pid: int
) -> WrkResult:
    argv = [
        wrk,
        f"-t{args.threads}",
        f"-c{args.connections}",
        f"-d{args.duration}s",
        "--timeout",
        "10s",
        "-s",
        str(GRADE_SCRIPT),
        url,
        "--",
        nonce,
        grader,
        str(args.rollouts),
        key,
    ]
    before, started = snapshot(pid, None), time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.duration + 60, check=False)
    after, wall = snapshot(pid, None), time.perf_counter() - started
    match = _BENCH_LINE.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"wrk failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    data = json.loads(match.group(1))
    duration = data["duration_us"] / 1e6
    ok = data["requests"] - data["errors"]["status"]
    lat = data["latency_us"]
    return WrkResult(
        requests=data["requests"],
        ok=ok,
        duration_s=duration,
        rps=ok / duration if duration else 0.0,
        errors=data["errors"],
        p50_ms=lat["p50"] / 1000,
        p90_ms=lat["p90"] / 1000,
        p99_ms=lat["p99"] / 1000,
        max_ms=lat["max"] / 1000,
        cpu=usage(before, after, wall),
        server_cpu_ms_per_call=0.0,
    )


def seed(url: str, key: str, nonce: str, rollouts: int, calls: int) -> None:
    """Log `calls` echo calls (one repeated, so no_loops has work) for each rollout the load grades."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        for rollout in range(rollouts):
            for i in range(calls):
                body = json.loads(call_body(nonce, "echo", rollout + rollouts * i, rollouts))
                body["trace_id"] = f"trace_{nonce}_{rollout}"
                if i == calls - 1:
                    body["arguments"] = json.dumps({"text": "hello 0"})
                response = client.post("/tools/echo", json=body)
                response.raise_for_status()
        check = client.post(
            "/grade/trace_multi",
            json={
                "sample": {"output_text": "x"},
                "item": {"reference_answer": "x"},
                "trace_id": f"trace_{nonce}_0",
            },
        )
        check.raise_for_status()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rollouts", type=int, default=64, help="distinct seeded rollouts graded")
    parser.add_argument("--calls", type=int, default=6, help="tool calls logged per rollout before grading")
    parser.add_argument("--graders", default=",".join(GRADERS))
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wrk = "wrk"
    if subprocess.run(["which", wrk], capture_output=True, check=False).returncode != 0:
        print("wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    key = secrets.token_hex(16)
    nonce = secrets.token_hex(4)
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
            "SPARRING_API_KEYS": f"admin:{key}",
            "SPARRING_PACKS": "bench.bench_pack",
            "SPARRING_HOME": str(env.workdir / "home"),
            "SPARRING_DATABASE_URL": env.database_url,
            "SPARRING_REDIS_URL": env.redis_url,
            "SPARRING_GRADERS_FILE": str(graders_file),
        },
        logs / "sparring.log",
        factory=True,
        ready_path="/readyz",
    )
    results: dict[str, list[tuple[WrkResult, WrkResult]]] = {name: [] for name in args.graders.split(",")}
    try:
        for server in (echo, sparring):
            server.start()
        for server in (echo, sparring):
            server.wait_ready()
        seed(sparring.url, key, nonce, args.rollouts, args.calls)
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
                graded = grade_wrk(wrk, sparring.url, name, nonce=nonce, key=key, args=args, pid=sparring.pid)
                results[name].append((baseline, graded))
                ratio = graded.rps / baseline.rps
                print(
                    f"round {round_ + 1} {name:12s} {graded.rps:8.0f} grades/s  "
                    f"echo {baseline.rps:8.0f} req/s  ratio {ratio:.2f}  "
                    f"p50 {graded.p50_ms:.1f} ms  p99 {graded.p99_ms:.1f} ms  errors {graded.errors}",
                    flush=True,
                )
    finally:
        for server in (sparring, echo):
            server.stop()
        env.teardown()
    print("\n| grader | grades/s | echo req/s | × echo | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|")
    for name, pairs in results.items():
        rate = median([g.rps for _, g in pairs])
        echo_rate = median([b.rps for b, _ in pairs])
        ratio = median([g.rps / b.rps for b, g in pairs])
        p50 = median([g.p50_ms for _, g in pairs])
        p99 = median([g.p99_ms for _, g in pairs])
        print(f"| `{name}` | {rate:.0f} | {echo_rate:.0f} | {ratio:.2f} | {p50:.1f} | {p99:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
