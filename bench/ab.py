"""Two or more versions of sparring, as users run it, measured in one run: which change moves the number.

    git worktree add /tmp/sparring-before <commit>
    python -m bench.ab --variant before=/tmp/sparring-before --variant after=. --rounds 4

Each variant is `sparring serve` with its defaults and the retail pack (as `bench.run`'s retail
scenarios), its code taken from the given checkout (put first on PYTHONPATH; the dependencies are
this environment's, so the variants must need the same ones). All variants run at once on one
Postgres database and one Redis database; round after round, in alternating order, each is loaded
by `wrk -t2 -c32` right after an echo run, and the ratio is taken pair by pair. With
`--database-per-variant`, each variant has a Postgres database of its own, migrated by its own
code: versions whose schemas differ (a new migration) can be measured side by side too. On a shared machine
whose speed drifts within seconds, that is what makes a difference of a few percent visible: runs of
separate `bench.run` invocations minutes apart differ by more than that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.run import (
    BENCH_DIR,
    DEFAULT_PG_ADMIN,
    DEFAULT_REDIS,
    SCENARIOS,
    Environment,
    Server,
    _pg_admin,
    build_servers,
    pg_url,
    retail_data_dir,
    retail_ids,
    run_wrk,
    running,
)

RETAIL_SCENARIOS = ("retail-read", "retail-write")  # bench.run's scenarios of `sparring serve`


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=CHECKOUT",
        help="a version to measure: a name and a checkout of sparring (repeatable; at least two)",
    )
    parser.add_argument("--scenario", choices=RETAIL_SCENARIOS, default="retail-read")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk run (default 5)")
    parser.add_argument(
        "--warmup", type=int, default=3, help="seconds of unmeasured load per server (0: none)"
    )
    parser.add_argument("--rollouts", type=int, default=500)
    parser.add_argument(
        "--database-per-variant",
        action="store_true",
        help="a database of its own per variant, at its own schema (for versions with other migrations)",
    )
    parser.add_argument("--pg-admin-url", default=DEFAULT_PG_ADMIN)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--results-dir", type=Path, default=BENCH_DIR / "results")
    args = parser.parse_args(argv)
    if len(args.variant) < 2:
        parser.error("give at least two --variant NAME=CHECKOUT")
    return args


def variant_database(env: Environment, database: str, checkout: Path) -> str:
    """A new database migrated by `checkout`'s own migrations; its URL."""
    drop = f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'
    asyncio.run(_pg_admin(env.pg_admin_url, [drop, f'CREATE DATABASE "{database}"']))
    url = pg_url(env.pg_admin_url, database)
    migrate = "import sys; from app.db.migrate import upgrade; upgrade(sys.argv[1])"
    subprocess.run(
        [sys.executable, "-c", migrate, url],
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": str(checkout)},
        check=True,
    )
    return url


def variants(specs: list[str]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        checkout = Path(path).resolve()
        if not sep or not name or not (checkout / "app" / "main.py").is_file():
            raise SystemExit(
                f"error: --variant {spec!r}: expected NAME=CHECKOUT of sparring (with app/main.py)"
            )
        if name in found or name == "echo":
            raise SystemExit(f"error: --variant {spec!r}: the name {name!r} is taken")
        found[name] = checkout
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    checkouts = variants(args.variant)
    wrk = shutil.which("wrk")
    if wrk is None:
        print("error: wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    scenario = SCENARIOS[args.scenario]
    tool = scenario.tool
    env = Environment(
        workdir=Path(tempfile.mkdtemp(prefix="sparring-ab-")),
        pg_admin_url=args.pg_admin_url,
        redis_url=args.redis_url,
        keep=False,
    )
    key = "bench-" + secrets.token_urlsafe(18)
    load = argparse.Namespace(threads=2, connections=32, duration=args.duration)
    warm = argparse.Namespace(threads=2, connections=32, duration=args.warmup)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in checkouts}
    started = datetime.now(UTC)
    try:
        env.create_postgres()
        env.retail_data = retail_data_dir()
        ids_file = retail_ids(env.retail_data, env.workdir)[scenario.request]
        servers = build_servers({"echo", "sparring-serve"}, env, key)
        template = servers.pop("sparring-serve")
        own_databases: list[str] = []
        databases: dict[str, str | None] = {}
        for index, (name, checkout) in enumerate(checkouts.items()):
            database: dict[str, str] = {}
            if args.database_per_variant:
                own_databases.append(f"{env.pg_database}_{index}")
                database["SPARRING_DATABASE_URL"] = variant_database(env, own_databases[-1], checkout)
            databases[name] = own_databases[-1] if args.database_per_variant else env.pg_database
            servers[name] = Server(
                name,
                template.target,
                {
                    **template.env,
                    **database,
                    "PYTHONPATH": str(checkout),
                    "SPARRING_HOME": str(env.workdir / f"home-{name}"),
                },
                env.workdir / "logs" / f"{name}.log",
                ready_path="/readyz",
                command=template.command,
            )
        echo = servers["echo"]

        def load_with(server: Server, settings: argparse.Namespace, database: str | None = None) -> Any:
            retail = server is not echo
            return run_wrk(
                wrk,
                server.url,
                nonce=secrets.token_hex(4),
                tool=tool if retail else "echo",
                rollouts=args.rollouts,
                key=key,
                args=settings,
                server_pid=server.pid,
                pg_database=database,
                ids_file=ids_file if retail else None,
            )

        with running(servers):
            for server in servers.values() if args.warmup > 0 else ():
                load_with(server, warm)
            for round_no in range(args.rounds):
                names = list(checkouts) if round_no % 2 == 0 else list(reversed(checkouts))
                for name in names:
                    base = load_with(echo, load)
                    run = load_with(servers[name], load, databases[name])
                    # Postgres's CPU per call: its backends connected to this variant's database only.
                    pg_ms = run.cpu.get("postgres_seconds", 0.0) * 1000 / max(run.ok, 1)
                    entry = {
                        "round": round_no + 1,
                        "rps": run.rps,
                        "echo_rps": base.rps,
                        "ratio": run.rps / base.rps,
                        "server_busy": run.server_cpu_ms_per_call * run.rps / 1000,
                        "cpu_ms_per_call": run.server_cpu_ms_per_call,
                        "echo_cpu_ms_per_call": base.server_cpu_ms_per_call,
                        "pg_cpu_ms_per_call": pg_ms,
                        "p99_ms": run.p99_ms,
                        "errors": run.requests - run.ok,
                    }
                    runs[name].append(entry)
                    print(
                        f"round {round_no + 1} {name:<12} {run.rps:6.0f} req/s / echo {base.rps:6.0f} = "
                        f"{entry['ratio']:.3f}  server busy {entry['server_busy']:.0%}  "
                        f"CPU/call {run.server_cpu_ms_per_call:.3f} ms "
                        f"(echo {base.server_cpu_ms_per_call:.3f})  Postgres/call {pg_ms:.3f} ms  "
                        f"p99 {run.p99_ms:.1f} ms",
                        flush=True,
                    )
    finally:
        if args.database_per_variant and env.pg_database is not None:
            drops = [f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)' for name in own_databases]
            asyncio.run(_pg_admin(env.pg_admin_url, drops))
        env.teardown()
    summary = {}
    for name, entries in runs.items():
        ratios = [e["ratio"] for e in entries]
        summary[name] = {
            "checkout": str(checkouts[name]),
            "ratio_median": statistics.median(ratios),
            "ratios": ratios,
            "server_busy_median": statistics.median(e["server_busy"] for e in entries),
            "cpu_ratio_median": statistics.median(
                e["echo_cpu_ms_per_call"] / e["cpu_ms_per_call"] for e in entries
            ),
            "pg_cpu_ms_per_call_median": statistics.median(e["pg_cpu_ms_per_call"] for e in entries),
            "errors": sum(e["errors"] for e in entries),
        }
        s = summary[name]
        print(
            f"{name:<12} x echo {s['ratio_median']:.3f} (rounds {', '.join(f'{r:.2f}' for r in ratios)})  "
            f"server busy {s['server_busy_median']:.0%}  CPU x echo {s['cpu_ratio_median']:.2f}  "
            f"Postgres/call {s['pg_cpu_ms_per_call_median']:.3f} ms  "
            f"errors {s['errors']}"
        )
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / f"ab-{started:%Y%m%d-%H%M%S}.json"
    config = {k: str(v) for k, v in vars(args).items()}
    path.write_text(
        json.dumps(
            {"started_at": started.isoformat(), "config": config, "summary": summary, "runs": runs}, indent=2
        )
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
