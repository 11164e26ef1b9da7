"""Instructions per call, counted by valgrind's callgrind: a measure of a call's cost that the machine's
neighbours cannot move.

    python -m bench.instructions --scenarios echo,full-pg --duration 30

Each scenario's server runs under `valgrind --tool=callgrind` with instrumentation off; after a
warm-up, it is switched on for one closed-loop wrk run (the same requests as `bench.run`) and the
instructions the server executed are divided by the calls it answered. Callgrind runs the server
some fifty times slower, so the call rate (and with it the size of Redis pipelines and log batches)
is not the one of a real run: compare scenarios, or two versions of the code, measured the same way,
not these counts with `bench.run`'s CPU times. Repeated runs agree to about a percent, where
`bench.run`'s CPU per call on a shared machine moves by a fifth.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.run import (
    DEFAULT_PG_ADMIN,
    DEFAULT_REDIS,
    LUA_SCRIPT,
    RETAIL_LUA_SCRIPT,
    SCENARIOS,
    Environment,
    build_servers,
    retail_data_dir,
    retail_ids,
    running,
    smoke,
    tool_arguments,
    wrk_script,
)

_TOTALS = re.compile(r"^totals:\s+(\d+)", re.MULTILINE)


def callgrind_total(path: Path) -> int:
    match = _TOTALS.search(path.read_text(errors="replace"))
    if match is None:
        raise RuntimeError(f"no instruction total in {path}")
    return int(match.group(1))


def wait_for_dump(out: Path, timeout: float = 120.0) -> tuple[Path, int]:
    """The file `callgrind_control -d` made (`<out>.1`) and its total, once callgrind wrote it all."""
    dump = out.with_name(out.name + ".1")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dump.exists():
            try:
                return dump, callgrind_total(dump)
            except RuntimeError:
                pass  # still being written: the totals line comes last
        time.sleep(0.5)
    raise RuntimeError(f"callgrind wrote no dump to {dump}")


def control(*argv: str) -> None:
    done = subprocess.run(["callgrind_control", *argv], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"callgrind_control {' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="echo,trivial-pg,full-pg")
    parser.add_argument("--duration", type=int, default=30, help="seconds of counted load per scenario")
    parser.add_argument("--warmup", type=int, default=15, help="seconds of uncounted load first")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument(
        "--save-profiles", action="store_true", help="keep each callgrind dump next to the results"
    )
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS or n.endswith("embedded")]
    if unknown:
        parser.error(f"unknown or unsupported scenarios: {', '.join(unknown)}")
    for tool in ("wrk", "valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is not on PATH")
    wrk = shutil.which("wrk")
    assert wrk is not None
    key = "sk-" + secrets.token_hex(16)
    load = argparse.Namespace(threads=1, connections=args.connections, duration=args.duration)
    warm = argparse.Namespace(threads=1, connections=args.connections, duration=args.warmup)
    results: list[dict[str, Any]] = []
    for name in names:
        scenario = SCENARIOS[name]
        env = Environment(
            workdir=Path(tempfile.mkdtemp(prefix="sparring-instr-")),
            pg_admin_url=args.pg_admin_url,
            redis_url=args.redis_url,
            keep=False,
        )
        try:
            if scenario.needs_services:
                env.create_postgres()
            ids_file: Path | None = None
            if scenario.server == "sparring-serve":  # the retail scenarios: `sparring serve` as shipped
                env.retail_data = retail_data_dir()
                ids_file = retail_ids(env.retail_data, env.workdir)[scenario.request]
            servers = build_servers({scenario.server}, env, key)
            server = servers[scenario.server]
            out = env.workdir / "callgrind.out"
            server.wrapper = [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}",
            ]

            def calls(
                settings: argparse.Namespace,
                url: str = server.url,
                tool: str = scenario.tool,
                ids: Path | None = ids_file,
                rollouts: int = scenario.rollouts or args.rollouts,
            ) -> Any:
                nonce = secrets.token_hex(4)  # new call ids (and rollouts) for every run
                if ids is not None:
                    return wrk_script(
                        wrk, RETAIL_LUA_SCRIPT, url, [nonce, tool, str(rollouts), key, str(ids)], settings
                    )
                return wrk_script(wrk, LUA_SCRIPT, url, [nonce, tool, str(rollouts), key], settings)

            with running(servers, ready_timeout=900):
                ids = ids_file.read_text().split() if ids_file is not None else None
                smoke(
                    server.url, scenario.tool, key, tool_arguments(scenario.request, 0, ids) if ids else None
                )
                calls(warm)
                control("-i", "on", str(server.pid))
                counted = calls(load)
                control("-i", "off", str(server.pid))
                control("-d", str(server.pid))
                dump, total = wait_for_dump(out)
                if args.save_profiles:
                    args.results_dir.mkdir(parents=True, exist_ok=True)
                    kept = args.results_dir / f"callgrind-{name}-{datetime.now(UTC):%Y%m%d-%H%M%S}.out"
                    shutil.copyfile(dump, kept)
                    print(f"profile: {kept} (read it with callgrind_annotate)")
            per_call = total / max(counted.ok, 1)
            row = {
                "scenario": name,
                "calls": counted.ok,
                "errors": counted.errors,
                "instructions": total,
                "instructions_per_call": round(per_call),
            }
            results.append(row)
            print(f"{name:<12} {counted.ok:>6} calls  {per_call / 1e6:8.3f} M instructions/call", flush=True)
        finally:
            env.teardown()
    base = next((r for r in results if r["scenario"] == "echo"), None)
    if base is not None:
        for row in results:
            row["x_echo"] = round(base["instructions_per_call"] / row["instructions_per_call"], 3)
            print(f"{row['scenario']:<12} echo/this = {row['x_echo']:.3f}")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    path = args.results_dir / f"instructions-{stamp}.json"
    path.write_text(
        json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2)
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
