"""A bounded soak: `sparring serve` (retail pack, Postgres + Redis) at a steady rate, memory sampled.

    python -m bench.soak                        # 50 req/s for 10 minutes, RSS every 10 s
    python -m bench.soak --duration 60          # a quick look

The server is started as users start it (`sparring serve`, its defaults, the retail pack), on a fresh
Postgres database and a Redis database of its own (bench.run's Environment). An open-loop generator
(bench.rate) sends `POST /tools` at a constant rate, alternating the retail read `get_order_details`
and the write `modify_user_address` over 500 rollouts, each call with a unique call id. The server's
resident memory is read from /proc every `--sample` seconds. It passes when every request was answered
with 2xx and every answered call is in the call log, and memory is flat: the last sample is within
`--max-growth-mb` of the sample taken a quarter into the run (caches and pools are warm by then).
Exit status 0 on a pass, 1 otherwise. Everything is bounded by --duration and removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.rate import constant_rate
from bench.run import (
    BENCH_DIR,
    DEFAULT_PG_ADMIN,
    DEFAULT_REDIS,
    Environment,
    build_servers,
    call_body,
    finite,
    machine_info,
    retail_data_dir,
    retail_ids,
    running,
    tool_arguments,
)

TOOLS = (("get_order_details", "order"), ("modify_user_address", "address"))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """RSS of one process every `every` seconds, in a thread, until stopped."""

    def __init__(self, pid: int, every: float) -> None:
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.monotonic()

    def _run(self) -> None:
        while True:
            self.samples.append((round(time.monotonic() - self._started, 1), rss_bytes(self.pid)))
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every + 5)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--rate", type=float, default=50.0, help="requests/s (default 50)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between RSS samples (default 10)")
    parser.add_argument("--rollouts", type=int, default=500, help="distinct trace ids (default 500)")
    parser.add_argument("--max-growth-mb", type=float, default=20.0, help="allowed RSS growth (default 20)")
    parser.add_argument("--pg-admin-url", default=os.environ.get("BENCH_PG_ADMIN_URL", DEFAULT_PG_ADMIN))
    parser.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", DEFAULT_REDIS))
    parser.add_argument("--results-dir", type=Path, default=BENCH_DIR / "results")
    args = parser.parse_args(argv)
    if not (0 < args.rate <= 1000 and 0 < args.duration <= 3600 and 1 <= args.sample <= 300):
        parser.error("--rate must be in (0, 1000], --duration in (0, 3600] s, --sample in [1, 300] s")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    started = datetime.now(UTC)
    key = "soak-" + secrets.token_urlsafe(18)
    env = Environment(
        workdir=Path(tempfile.mkdtemp(prefix="sparring-soak-")),
        pg_admin_url=args.pg_admin_url,
        redis_url=args.redis_url,
        keep=False,
    )
    info = machine_info()
    try:
        env.create_postgres()
        env.retail_data = retail_data_dir()
        ids = {
            kind: path.read_text().split() for kind, path in retail_ids(env.retail_data, env.workdir).items()
        }
        servers = build_servers({"sparring-serve"}, env, key)
        server = servers["sparring-serve"]
        nonce = secrets.token_hex(4)

        def body(i: int) -> bytes:
            n = i if i >= 0 else 10_000_000 - i
            tool, kind = TOOLS[n % 2]
            return call_body(nonce, tool, n, args.rollouts, tool_arguments(kind, n, ids[kind]))

        with running(servers):
            print(
                f"soak: {args.rate:g} req/s for {args.duration:g} s against {server.url} (pid {server.pid})"
            )
            with Sampler(server.pid, args.sample) as sampler:
                result = asyncio.run(
                    constant_rate(
                        f"{server.url}/tools",
                        body,
                        rate=args.rate,
                        duration=args.duration,
                        headers={"Authorization": f"Bearer {key}"},
                    )
                )
        counts = env.log_counts().get("sparring-pg", {})
    finally:
        env.teardown()

    samples = sampler.samples
    quarter = next((rss for t, rss in samples if t >= args.duration / 4), samples[0][1])
    growth_mb = (samples[-1][1] - quarter) / 2**20
    logged = sum(sum(counts.get(tool, {}).values()) for tool, _ in TOOLS)
    errors = result.non_2xx + result.failed + result.dropped
    checks = {
        "zero errors": errors == 0,
        "every answered call logged": logged >= result.ok,
        f"memory flat (growth <= {args.max_growth_mb:g} MB after the first quarter)": growth_mb
        <= args.max_growth_mb,
    }
    for t, rss in samples:
        print(f"  {t:7.1f} s  RSS {rss / 2**20:7.1f} MB")
    print(
        f"{result.ok} ok, {result.non_2xx} non-2xx, {result.failed} failed, {result.dropped} dropped, "
        f"{result.late_sends} sent late; p50 {result.p50_ms:.1f} ms, p99 {result.p99_ms:.1f} ms, "
        f"max {result.max_ms:.1f} ms; {logged} calls logged; RSS growth {growth_mb:+.1f} MB"
    )
    for answer in result.not_2xx:
        print(f"  not 2xx: {answer}")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")

    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"soak-{started.strftime('%Y%m%d-%H%M%S')}.json"
    report: dict[str, Any] = {
        "started_at": started.isoformat(),
        "finished_at": datetime.now(UTC).isoformat(),
        "machine": info,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "result": result.as_dict(),
        "rss_samples": samples,
        "rss_growth_mb": growth_mb,
        "logged": logged,
        "checks": checks,
    }
    out.write_text(json.dumps(finite(report), indent=2))
    print(f"results: {out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
