"""Benchmark sparring's tool route against a bare FastAPI echo, in the same run, with wrk.

    python -m bench.run                        # every scenario, 3 rounds of 10 s runs
    python -m bench.run --rounds 5 --duration 15
    python -m bench.run --scenarios echo,full-pg --profile full-pg

It starts every server itself (uvicorn, one worker each, the same loop and HTTP implementation), on
free loopback ports: the echo baseline, the naive handler, sparring on Postgres + Redis (a fresh
database migrated with app.db.migrate.upgrade, a dedicated Redis db flushed before and after) and
sparring on the embedded backend (SQLite + in-memory state). It alternates baseline and subject runs
(echo, subject, echo, subject, ...) because the machine is shared and noisy, and reports medians. Each
load run is bounded in time; servers, database and Redis keys are removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.cpu import CpuSnapshot, snapshot, usage
from bench.rate import RateResult, constant_rate

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "bench"
LUA_SCRIPT = BENCH_DIR / "wrk" / "post.lua"
MCP_LUA_SCRIPT = BENCH_DIR / "wrk" / "mcp.lua"
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}
RETAIL_LUA_SCRIPT = BENCH_DIR / "wrk" / "retail.lua"
LOOPBACK = "127.0.0.1"

DEFAULT_PG_ADMIN = "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/13"

# The same uvicorn settings for every server: one worker, uvloop, httptools, no access log.
UVICORN_FLAGS = [
    "--host",
    LOOPBACK,
    "--workers",
    "1",
    "--loop",
    "uvloop",
    "--http",
    "httptools",
    "--log-level",
    "warning",
    "--no-access-log",
]


@dataclass(frozen=True)
class Scenario:
    name: str
    server: str
    tool: str
    label: str
    needs_services: bool
    mcp: bool = False  # the call goes to /mcp as an MCP tools/call instead of POST /tools/<tool>
    # What the arguments are: "text" ({"text": ...}), "order" (a retail order id), "address" (a user's
    # new address).
    request: str = "text"
    threads: int | None = None  # wrk threads, if not --threads
    rollouts: int | None = None  # distinct trace ids, if not --rollouts
    baseline: str = "echo"  # the echo run paired with it (same wrk settings)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("echo", "echo", "echo", "bare FastAPI echo (baseline)", False),
        # As users run it: `sparring serve` with its defaults, the retail pack, Postgres + Redis, 500
        # rollouts, two wrk threads; paired with an echo run under the same wrk settings.
        Scenario("echo-t2", "echo", "echo", "bare FastAPI echo, wrk -t2 (baseline)", False, threads=2),
        Scenario(
            "retail-read",
            "sparring-serve",
            "get_order_details",
            "sparring serve: retail get_order_details",
            True,
            request="order",
            threads=2,
            rollouts=500,
            baseline="echo-t2",
        ),
        Scenario(
            "retail-write",
            "sparring-serve",
            "modify_user_address",
            "sparring serve: retail modify_user_address",
            True,
            request="address",
            threads=2,
            rollouts=500,
            baseline="echo-t2",
        ),
        Scenario("naive", "naive", "echo", "naive: echo + Redis INCR + 1-row PG INSERT", True),
        Scenario("trivial-pg", "sparring-pg", "echo", "sparring trivial tool, PG + Redis", True),
        Scenario("full-pg", "sparring-pg", "bump", "sparring full path, PG + Redis", True),
        Scenario("mcp-trivial-pg", "sparring-pg", "echo", "MCP trivial tool, PG + Redis", True, mcp=True),
        Scenario("mcp-full-pg", "sparring-pg", "bump", "MCP full path, PG + Redis", True, mcp=True),
        Scenario("trivial-embedded", "sparring-embedded", "echo", "sparring trivial tool, embedded", False),
        Scenario("full-embedded", "sparring-embedded", "bump", "sparring full path, embedded", False),
        Scenario(
            "mcp-trivial-embedded", "sparring-embedded", "echo", "MCP trivial tool, embedded", False, mcp=True
        ),
    ]
}
BASELINE = "echo"
BASELINES = {s.baseline for s in SCENARIOS.values()}
# Each MCP scenario and the tool-route scenario it is measured against (same server, same tool).
MCP_PAIRS = {
    "mcp-trivial-pg": "trivial-pg",
    "mcp-full-pg": "full-pg",
    "mcp-trivial-embedded": "trivial-embedded",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def clean_env() -> dict[str, str]:
    """The environment without any sparring setting that could leak into a server."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SPARRING_", "BENCH_")) and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# --- servers -----------------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    target: str
    env: dict[str, str]
    log_path: Path
    factory: bool = False
    ready_path: str = "/healthz"
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    wrapper: list[str] = field(default_factory=list)  # a command the server runs under (valgrind)
    command: list[str] | None = None  # instead of uvicorn with UVICORN_FLAGS (e.g. `sparring serve`)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> None:
        argv = [
            *self.wrapper,
            sys.executable,
            "-m",
            "uvicorn",
            self.target,
            "--port",
            str(self.port),
            *UVICORN_FLAGS,
        ]
        if self.factory:
            argv.append("--factory")
        if self.command is not None:
            argv = [*self.wrapper, *self.command]
            self.env["SPARRING_PORT"] = str(self.port)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"server {self.name} exited at start-up:\n{self.tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server {self.name} not ready after {timeout:g} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=35)  # sparring drains its call log on shutdown
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


# --- databases ---------------------------------------------------------------------------------------


def pg_url(admin_url: str, database: str) -> str:
    return admin_url.rsplit("/", 1)[0] + f"/{database}"


async def _pg_admin(admin_url: str, statements: list[str]) -> None:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            for statement in statements:
                await conn.execute(text(statement))
    finally:
        await engine.dispose()


async def _pg_counts(url: str) -> dict[str, Any]:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url)
    counts: dict[str, Any] = {}
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT tool, outcome, count(*) FROM tool_calls GROUP BY tool, outcome")
            )
            for tool, outcome, count in rows:
                counts.setdefault(tool, {})[outcome] = int(count)
            exists = await conn.scalar(text("SELECT to_regclass('bench_naive_calls') IS NOT NULL"))
            if exists:
                counts["(naive)"] = {
                    "ok": int(await conn.scalar(text("SELECT count(*) FROM bench_naive_calls")))
                }
    finally:
        await engine.dispose()
    return counts


def sqlite_counts(path: Path) -> dict[str, Any]:
    counts: dict[str, Any] = {}
    with sqlite3.connect(path) as conn:
        for tool, outcome, count in conn.execute(
            "SELECT tool, outcome, count(*) FROM tool_calls GROUP BY tool, outcome"
        ):
            counts.setdefault(tool, {})[outcome] = int(count)
    return counts


def flush_redis(url: str) -> None:
    from redis import Redis

    client = Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


# Redis databases a run may take when it was given the default URL (db 9 is the test suite's). Each run
# takes one that no live run owns, so that two runs at once (several people share this machine, and
# tests/bench runs the drivers too) never flush each other's claims and locks mid-run.
REDIS_BENCH_DBS = (13, 12, 11, 10, 15)
REDIS_OWNER_KEY = "sparring-bench:owner"
REDIS_OWNER_TTL = 6 * 3600


def _owner_alive(owner: bytes | str | None) -> bool:
    if owner is None:
        return False
    text = owner.decode(errors="replace") if isinstance(owner, bytes) else owner
    host, _, pid = text.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another machine's run: cannot check, assume it is alive until its key expires
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def take_redis_db(url: str) -> str:
    """A Redis database for this run, marked as ours, flushed: `url`'s own database if no live run owns
    it, else (for the default URL only) the first free one of REDIS_BENCH_DBS."""
    from redis import Redis

    base, _, db = url.rpartition("/")
    candidates = [url]
    if url == DEFAULT_REDIS:
        candidates += [f"{base}/{n}" for n in REDIS_BENCH_DBS if str(n) != db]
    me = f"{socket.gethostname()}:{os.getpid()}"
    for candidate in candidates:
        client = Redis.from_url(candidate)
        try:
            taken = client.set(REDIS_OWNER_KEY, me, nx=True, ex=REDIS_OWNER_TTL)
            if not taken and not _owner_alive(client.get(REDIS_OWNER_KEY)):
                client.set(REDIS_OWNER_KEY, me, ex=REDIS_OWNER_TTL)  # its run died without cleaning up
                taken = True
            if taken:
                client.flushdb()
                client.set(REDIS_OWNER_KEY, me, ex=REDIS_OWNER_TTL)
                return candidate
        finally:
            client.close()
    raise RuntimeError(
        f"every bench Redis database is in use by another run ({', '.join(candidates)}); "
        f"wait for it, or pass --redis-url with a free database"
    )


@dataclass
class Environment:
    """Everything the run created: removed again by `teardown`."""

    workdir: Path
    pg_admin_url: str
    redis_url: str
    keep: bool
    pg_database: str | None = None
    sqlite_path: Path | None = None
    retail_data: Path | None = None

    @property
    def database_url(self) -> str:
        assert self.pg_database is not None
        return pg_url(self.pg_admin_url, self.pg_database)

    def create_postgres(self) -> None:
        from app.db.migrate import upgrade

        self.pg_database = f"sparring_bench_{os.getpid()}"
        drop = f'DROP DATABASE IF EXISTS "{self.pg_database}" WITH (FORCE)'
        asyncio.run(_pg_admin(self.pg_admin_url, [drop, f'CREATE DATABASE "{self.pg_database}"']))
        upgrade(self.database_url)
        self.redis_url = take_redis_db(self.redis_url)

    def create_sqlite(self) -> None:
        from app.db.migrate import upgrade

        self.sqlite_path = self.workdir / "embedded" / "sparring.db"
        self.sqlite_path.parent.mkdir(parents=True, exist_ok=True)
        upgrade(f"sqlite+aiosqlite:///{self.sqlite_path}")

    def log_counts(self) -> dict[str, dict[str, Any]]:
        counts: dict[str, dict[str, Any]] = {}
        if self.pg_database is not None:
            counts["sparring-pg"] = asyncio.run(_pg_counts(self.database_url))
        if self.sqlite_path is not None:
            counts["sparring-embedded"] = sqlite_counts(self.sqlite_path)
        return counts

    def teardown(self) -> None:
        if self.keep:
            print(f"kept: database {self.pg_database}, redis {self.redis_url}, files in {self.workdir}")
            return
        if self.pg_database is not None:
            drop = f'DROP DATABASE IF EXISTS "{self.pg_database}" WITH (FORCE)'
            try:
                asyncio.run(_pg_admin(self.pg_admin_url, [drop]))
                flush_redis(self.redis_url)
            except Exception as exc:
                print(f"warning: cleanup failed: {exc}", file=sys.stderr)
        shutil.rmtree(self.workdir, ignore_errors=True)


def build_servers(
    needed: set[str], env: Environment, api_key: str, serve_env: list[str] | None = None
) -> dict[str, Server]:
    base = clean_env()
    servers: dict[str, Server] = {}
    logs = env.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sparring = {"SPARRING_API_KEYS": f"tools:{api_key}", "SPARRING_PACKS": "bench.bench_pack"}
    if "echo" in needed:
        servers["echo"] = Server("echo", "bench.echo_app:app", dict(base), logs / "echo.log")
    if "naive" in needed:
        naive_env = {
            **base,
            "BENCH_NAIVE_DATABASE_URL": env.database_url,
            "BENCH_NAIVE_REDIS_URL": env.redis_url,
        }
        servers["naive"] = Server("naive", "bench.naive_app:app", naive_env, logs / "naive.log")
    if "sparring-pg" in needed:
        pg_env = {
            **base,
            **sparring,
            "SPARRING_HOME": str(env.workdir / "home-pg"),
            "SPARRING_DATABASE_URL": env.database_url,
            "SPARRING_REDIS_URL": env.redis_url,
        }
        servers["sparring-pg"] = Server(
            "sparring-pg", "app.main:create_app", pg_env, logs / "sparring-pg.log", factory=True
        )
        servers["sparring-pg"].ready_path = "/readyz"
    if "sparring-embedded" in needed:
        assert env.sqlite_path is not None
        embedded_env = {
            **base,
            **sparring,
            "SPARRING_HOME": str(env.workdir / "home-embedded"),
            "SPARRING_DATABASE_URL": f"sqlite+aiosqlite:///{env.sqlite_path}",
        }
        servers["sparring-embedded"] = Server(
            "sparring-embedded",
            "app.main:create_app",
            embedded_env,
            logs / "sparring-embedded.log",
            factory=True,
            ready_path="/readyz",
        )
    if "sparring-serve" in needed:
        # Exactly as the README starts it: `sparring serve` and its defaults (one worker, uvicorn's
        # own settings, the access log as shipped); only where the data and services are, the keys,
        # the pack and the port are set.
        assert env.retail_data is not None
        serve_env = {
            **base,
            "SPARRING_API_KEYS": f"tools:{api_key}",
            "SPARRING_PACKS": "retail",
            "SPARRING_RETAIL_DATA": str(env.retail_data),
            "SPARRING_HOME": str(env.workdir / "home-serve"),
            "SPARRING_DATABASE_URL": env.database_url,
            "SPARRING_REDIS_URL": env.redis_url,
            **dict(item.split("=", 1) for item in serve_env or []),
        }
        servers["sparring-serve"] = Server(
            "sparring-serve",
            "sparring serve",
            serve_env,
            logs / "sparring-serve.log",
            ready_path="/readyz",
            command=[str(Path(sys.executable).parent / "sparring"), "serve"],
        )
    return servers


def retail_data_dir() -> Path:
    """The retail data: SPARRING_RETAIL_DATA if set, else fetched once into .sparring/ (as
    `sparring packs fetch retail` does)."""
    from tools.retail import data as retail_data

    return Path(
        os.environ.get("SPARRING_RETAIL_DATA")
        or retail_data.DATA.fetch(retail_data.DATA.cache_dir(ROOT / ".sparring"))
    )


def retail_ids(data_dir: Path, workdir: Path) -> dict[str, Path]:
    """Files of order ids and user ids of the retail data, one a line, for the wrk script."""
    db = json.loads((data_dir / "db.json").read_text())
    files = {"order": workdir / "order_ids.txt", "address": workdir / "user_ids.txt"}
    files["order"].write_text("\n".join(sorted(db["orders"])) + "\n")
    files["address"].write_text("\n".join(sorted(db["users"])) + "\n")
    return files


def tool_arguments(request: str, i: int, ids: list[str] | None) -> dict[str, Any]:
    """The arguments the wrk scripts send for call number i (the same shapes, for smoke and steady runs)."""
    if request == "order":
        assert ids
        return {"order_id": ids[i % len(ids)]}
    if request == "address":
        assert ids
        return {
            "user_id": ids[i % len(ids)], "address1": f"{i} Elm Street", "address2": "Suite 1",
            "city": "Austin", "state": "TX", "country": "USA", "zip": "78701",
        }  # fmt: skip
    return {"text": f"hello {i}"}


# --- load --------------------------------------------------------------------------------------------


def call_body(
    nonce: str, tool: str, i: int, rollouts: int, arguments_object: dict[str, Any] | None = None
) -> bytes:
    """The same envelope the wrk script sends (unique call_id, one of `rollouts` trace ids)."""
    rollout = i % rollouts
    arguments = json.dumps(arguments_object if arguments_object is not None else {"text": f"hello {i}"})
    body = {
        "type": "function_call",
        "id": f"fc_{nonce}_{i}",
        "call_id": f"call_{nonce}_{i}",
        "name": tool,
        "arguments": arguments,
        "trace_id": f"trace_{nonce}_{rollout}",
        "item": {"id": f"row_{rollout}"},
    }
    return json.dumps(body).encode()


@dataclass(frozen=True)
class WrkResult:
    requests: int
    ok: int
    duration_s: float
    rps: float  # 2xx answers per second
    errors: dict[str, int]
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    cpu: dict[str, float]  # shares of one core (server, postgres, redis, loadgen) and the machine's busy %
    server_cpu_ms_per_call: float


_BENCH_LINE = re.compile(r"^BENCH_JSON (\{.*\})$", re.MULTILINE)


def run_wrk(
    wrk: str,
    url: str,
    *,
    nonce: str,
    tool: str,
    rollouts: int,
    key: str,
    args: argparse.Namespace,
    server_pid: int | None = None,
    pg_database: str | None = None,
    mcp: bool = False,
    ids_file: Path | None = None,
) -> WrkResult:
    if ids_file is not None:
        script, script_args = RETAIL_LUA_SCRIPT, [nonce, tool, str(rollouts), key, str(ids_file)]
    else:
        script, script_args = MCP_LUA_SCRIPT if mcp else LUA_SCRIPT, [nonce, tool, str(rollouts), key]
    return wrk_script(wrk, script, url, script_args, args, server_pid=server_pid, pg_database=pg_database)


def wrk_script(
    wrk: str,
    script: Path,
    url: str,
    script_args: list[str],
    args: argparse.Namespace,
    *,
    server_pid: int | None = None,
    pg_database: str | None = None,
) -> WrkResult:
    """One closed-loop wrk run of a Lua script that ends with a BENCH_JSON line; CPU use around it."""
    argv = [
        wrk,
        f"-t{args.threads}",
        f"-c{args.connections}",
        f"-d{args.duration}s",
        "--timeout",
        "10s",
        "-s",
        str(script),
        url,
        "--",
        *script_args,
    ]
    before, started = snapshot(server_pid, pg_database), time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.duration + 60, check=False)
    after, wall = snapshot(server_pid, pg_database), time.perf_counter() - started
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
        server_cpu_ms_per_call=cpu_seconds(before, after, server_pid) * 1000 / max(ok, 1),
    )


def cpu_seconds(before: CpuSnapshot, after: CpuSnapshot, pid: int | None) -> float:
    if pid is None or pid not in after.processes:
        return 0.0
    return after.processes[pid][1] - before.processes.get(pid, ("server", after.processes[pid][1]))[1]


def mcp_call_body(nonce: str, tool: str, i: int) -> bytes:
    """The JSON-RPC tools/call the MCP wrk script sends (a unique id)."""
    params = {"name": tool, "arguments": {"text": f"hello {i}"}}
    return json.dumps(
        {"jsonrpc": "2.0", "id": f"{nonce}_{i}", "method": "tools/call", "params": params}
    ).encode()


def mcp_smoke(url: str, tool: str, key: str) -> None:
    """One MCP call before any load: a tool result (not an error) with the tool's output."""
    response = httpx.post(
        f"{url}/mcp",
        content=mcp_call_body(f"smoke{secrets.token_hex(4)}", tool, 0),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json", **MCP_HEADERS},
        timeout=10,
    )
    result = response.json().get("result") or {}
    content = result.get("content") or [{}]
    if response.status_code != 200 or result.get("isError") or "hello 0" not in str(content[0].get("text")):
        raise RuntimeError(f"unexpected MCP answer from {url}/mcp: {response.status_code} {response.text}")


def smoke(url: str, tool: str, key: str, arguments: dict[str, Any] | None = None) -> None:
    """One call before any load: the server answers the envelope as expected."""
    body = call_body(f"smoke{secrets.token_hex(4)}", tool, 0, 1, arguments)
    expected = "hello 0" if arguments is None else str(next(iter(arguments.values())))
    response = httpx.post(
        f"{url}/tools/{tool}",
        content=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=10,
    )
    data = response.json()
    sent = json.loads(body)
    if (
        response.status_code != 200
        or data.get("type") != "function_call_output"
        or data.get("call_id") != sent["call_id"]
        or data.get("id") != sent["id"]
        or expected not in str(data.get("output"))
        or str(data.get("output")).startswith("Error")
    ):
        raise RuntimeError(f"unexpected answer from {url}/tools/{tool}: {response.status_code} {data}")


# --- the run -----------------------------------------------------------------------------------------


@dataclass
class Record:
    """Every measurement of a scenario across rounds."""

    wrk: list[WrkResult] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # rps / rps of the echo run just before it
    # echo's server CPU per call / this server's CPU per call, same pairs: the ratio the rates would
    # have if each server were bound by its own CPU, whatever the neighbours took
    cpu_ratios: list[float] = field(default_factory=list)
    rate: list[RateResult] = field(default_factory=list)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Bench:
    def __init__(
        self,
        args: argparse.Namespace,
        servers: dict[str, Server],
        wrk: str,
        key: str,
        pg_database: str | None = None,
    ) -> None:
        self.args = args
        self.pg_database = pg_database
        self.servers = servers
        self.wrk = wrk
        self.key = key
        self.base_nonce = secrets.token_hex(3)
        self.counter = 0
        self.records: dict[str, Record] = {name: Record() for name in args.scenario_list}
        self.ids_files: dict[str, Path] = {}  # request kind -> file of ids (retail scenarios)
        self.ids: dict[str, list[str]] = {}

    def nonce(self) -> str:
        self.counter += 1
        return f"{self.base_nonce}r{self.counter}"

    def scenario_args(self, scenario: Scenario, args: argparse.Namespace | None = None) -> argparse.Namespace:
        args = args or self.args
        return argparse.Namespace(**{**vars(args), "threads": scenario.threads or args.threads})

    def arguments(self, scenario: Scenario, i: int) -> dict[str, Any] | None:
        if scenario.request == "text":
            return None
        return tool_arguments(scenario.request, i, self.ids[scenario.request])

    def load(self, name: str, args: argparse.Namespace | None = None, *, measure: bool = True) -> WrkResult:
        scenario = SCENARIOS[name]
        server = self.servers[scenario.server]
        return run_wrk(
            self.wrk,
            server.url,
            nonce=self.nonce(),
            tool=scenario.tool,
            rollouts=scenario.rollouts or self.args.rollouts,
            key=self.key,
            args=self.scenario_args(scenario, args),
            server_pid=server.pid if measure else None,
            pg_database=self.pg_database if measure else None,
            mcp=scenario.mcp,
            ids_file=self.ids_files.get(scenario.request),
        )

    def steady(self, name: str) -> RateResult:
        scenario = SCENARIOS[name]
        server = self.servers[scenario.server]
        nonce = self.nonce()
        rollouts = scenario.rollouts or self.args.rollouts
        headers = {"Authorization": f"Bearer {self.key}"}

        def body(i: int) -> bytes:
            n = i if i >= 0 else 1_000_000 - i
            if scenario.mcp:
                return mcp_call_body(nonce, scenario.tool, n)
            return call_body(nonce, scenario.tool, n, rollouts, self.arguments(scenario, n))

        if scenario.mcp:
            # One session for the steady run: its calls are one rollout's, as a conversation's are.
            headers.update({**MCP_HEADERS, "Content-Type": "application/json", "Mcp-Session-Id": nonce})
        return asyncio.run(
            constant_rate(
                f"{server.url}/mcp" if scenario.mcp else f"{server.url}/tools/{scenario.tool}",
                body,
                rate=self.args.rate,
                duration=self.args.rate_duration,
                headers=headers,
            )
        )

    def pause(self) -> None:
        time.sleep(self.args.pause)

    def run(self) -> None:
        names = self.args.scenario_list
        for name in names:
            scenario = SCENARIOS[name]
            if scenario.mcp:
                mcp_smoke(self.servers[scenario.server].url, scenario.tool, self.key)
            else:
                smoke(self.servers[scenario.server].url, scenario.tool, self.key, self.arguments(scenario, 0))
        if self.args.warmup > 0:
            warm = argparse.Namespace(**{**vars(self.args), "duration": self.args.warmup})
            for name in names:
                print(f"warm-up {name} ({self.args.warmup} s)", flush=True)
                self.load(name, warm, measure=False)
        subjects = [n for n in names if n not in BASELINES]
        for round_no in range(self.args.rounds):
            # Rotate the subjects so that none always runs at the same point of a round.
            shift = round_no % len(subjects) if subjects else 0
            order = subjects[shift:] + subjects[:shift]
            for name in order or [BASELINE]:
                echo: WrkResult | None = None
                if BASELINE in names:
                    baseline = SCENARIOS[name].baseline
                    echo = self.load(baseline)
                    self.records.setdefault(baseline, Record()).wrk.append(echo)
                    print(self._line(round_no, baseline, echo), flush=True)
                    self.pause()
                if name == BASELINE:
                    continue
                result = self.load(name)
                record = self.records[name]
                record.wrk.append(result)
                if echo is not None and echo.rps > 0:
                    record.ratios.append(result.rps / echo.rps)
                if echo is not None and result.server_cpu_ms_per_call > 0:
                    record.cpu_ratios.append(echo.server_cpu_ms_per_call / result.server_cpu_ms_per_call)
                print(self._line(round_no, name, result), flush=True)
                self.pause()
            if self.args.rate > 0:
                for name in ([BASELINE] if BASELINE in names else []) + order:
                    steady = self.steady(name)
                    self.records[name].rate.append(steady)
                    print(
                        f"round {round_no + 1} {name:<17} {steady.rate:g} req/s steady: "
                        f"p50 {steady.p50_ms:.1f} ms  p99 {steady.p99_ms:.1f} ms  "
                        f"({steady.ok} ok, {steady.non_2xx + steady.failed + steady.dropped} not)",
                        flush=True,
                    )
                    self.pause()

    def _line(self, round_no: int, name: str, result: WrkResult) -> str:
        bad = result.requests - result.ok + sum(v for k, v in result.errors.items() if k != "status")
        cpu = result.cpu
        return (
            f"round {round_no + 1} {name:<17} {result.rps:8.0f} req/s  "
            f"p50 {result.p50_ms:6.1f} ms  p99 {result.p99_ms:6.1f} ms  "
            f"server {cpu.get('server_pct', 0):3.0f}% ({result.server_cpu_ms_per_call:.2f} ms/call)  "
            f"pg {cpu.get('postgres_pct', 0):3.0f}%  redis {cpu.get('redis_pct', 0):3.0f}%  "
            f"wrk {cpu.get('loadgen_pct', 0):3.0f}%  machine {cpu.get('machine_busy_pct', 0):3.0f}%"
            + (f"  ({bad} errors)" if bad else "")
        )

    def profile(self, name: str, py_spy: str, out_dir: Path, stamp: str, fmt: str) -> Path:
        """One extra (unmeasured) wrk run of `name` while py-spy samples its server."""
        scenario = SCENARIOS[name]
        server = self.servers[scenario.server]
        suffix = {"flamegraph": "svg", "speedscope": "speedscope.json", "raw": "collapsed.txt"}[fmt]
        out = out_dir / f"{stamp}-{name}.{suffix}"
        spy = subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(server.pid),
                "--duration",
                str(self.args.duration),
                "--rate",
                "250",
                "--format",
                fmt,
                "--output",
                str(out),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(1.0)
        try:
            result = self.load(name)
        finally:
            try:
                _, err = spy.communicate(timeout=self.args.duration + 60)
            except subprocess.TimeoutExpired:
                spy.kill()
                _, err = spy.communicate()
        if spy.returncode != 0:
            print(f"py-spy failed: {err.decode(errors='replace')}", file=sys.stderr)
        print(f"profiled {name}: {result.rps:.0f} req/s under py-spy -> {out}")
        return out


# --- reporting ---------------------------------------------------------------------------------------


def summarize(records: dict[str, Record], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, record in records.items():
        scenario = SCENARIOS[name]
        base = records.get(scenario.baseline)
        echo_rps = median([r.rps for r in base.wrk]) if base is not None else float("nan")
        rps = median([r.rps for r in record.wrk])
        rows.append(
            {
                "scenario": name,
                "label": scenario.label,
                "rps_median": rps,
                "rps_runs": [round(r.rps, 1) for r in record.wrk],
                "ratio_to_echo": 1.0 if name in BASELINES else median(record.ratios),
                "ratio_of_medians": rps / echo_rps if echo_rps else float("nan"),
                "ratio_runs": [round(x, 3) for x in record.ratios],
                "cpu_ratio_to_echo": 1.0 if name in BASELINES else median(record.cpu_ratios),
                f"p50_ms_c{args.connections}": median([r.p50_ms for r in record.wrk]),
                f"p99_ms_c{args.connections}": median([r.p99_ms for r in record.wrk]),
                f"p50_ms_at_{args.rate:g}rps": median([r.p50_ms for r in record.rate]),
                f"p99_ms_at_{args.rate:g}rps": median([r.p99_ms for r in record.rate]),
                "server_cpu_pct": median([r.cpu.get("server_pct", math.nan) for r in record.wrk]),
                "server_cpu_ms_per_call": median([r.server_cpu_ms_per_call for r in record.wrk]),
                "postgres_cpu_pct": median([r.cpu.get("postgres_pct", math.nan) for r in record.wrk]),
                "redis_cpu_pct": median([r.cpu.get("redis_pct", math.nan) for r in record.wrk]),
                "machine_busy_pct": median([r.cpu.get("machine_busy_pct", math.nan) for r in record.wrk]),
                "non_2xx_or_errors": sum(
                    r.requests - r.ok + sum(v for k, v in r.errors.items() if k != "status")
                    for r in record.wrk
                )
                + sum(r.non_2xx + r.failed + r.dropped for r in record.rate),
                "answered_2xx": sum(r.ok for r in record.wrk) + sum(r.ok for r in record.rate),
            }
        )
    by_name = {row["scenario"]: row for row in rows}
    for name, route in MCP_PAIRS.items():
        if name in by_name and route in by_name:
            # Both normalized by the echo run just before them, so the shared machine's mood cancels out.
            mcp, http = by_name[name], by_name[route]
            mcp["ratio_to_tool_route"] = mcp["ratio_to_echo"] / http["ratio_to_echo"]
            mcp["rps_ratio_to_tool_route"] = mcp["rps_median"] / http["rps_median"]
            # The steadiest of the three on a shared machine: the route's server CPU per call / MCP's.
            mcp["cpu_ratio_to_tool_route"] = http["server_cpu_ms_per_call"] / mcp["server_cpu_ms_per_call"]
    return rows


def mcp_lines(rows: list[dict[str, Any]]) -> list[str]:
    return [
        f"{row['scenario']}: {row['ratio_to_tool_route']:.2f} x the tool route {MCP_PAIRS[row['scenario']]} "
        f"(x echo {row['ratio_to_echo']:.2f}; medians of req/s: {row['rps_ratio_to_tool_route']:.2f}; "
        f"server CPU per call: {row['cpu_ratio_to_tool_route']:.2f})"
        for row in rows
        if "ratio_to_tool_route" in row
    ]


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    c = args.connections
    rate = f"{args.rate:g}"
    headers = [
        "scenario",
        "req/s",
        "x echo",
        f"p50 c{c}",
        f"p99 c{c}",
        f"p50 @{rate}/s",
        f"p99 @{rate}/s",
        "server CPU",
        "ms CPU/call",
        "CPU x echo",
        "errors",
    ]
    lines = []
    for row in rows:
        lines.append(
            [
                row["label"],
                f"{row['rps_median']:.0f}",
                f"{row['ratio_to_echo']:.2f}",
                f"{row[f'p50_ms_c{c}']:.1f} ms",
                f"{row[f'p99_ms_c{c}']:.1f} ms",
                f"{row[f'p50_ms_at_{rate}rps']:.1f} ms",
                f"{row[f'p99_ms_at_{rate}rps']:.1f} ms",
                f"{row['server_cpu_pct']:.0f}%",
                f"{row['server_cpu_ms_per_call']:.2f}",
                f"{row['cpu_ratio_to_echo']:.2f}",
                str(row["non_2xx_or_errors"]),
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(headers, *lines, strict=True)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *(fmt(line) for line in lines)])


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        info["loadavg_before"] = os.getloadavg()
    except OSError:
        pass
    return info


# --- entry point -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--scenarios",
        default=",".join(n for n in SCENARIOS if n not in BASELINES - {BASELINE}),
        help=f"comma-separated, from: {', '.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="baseline/subject alternations (default 3)")
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="seconds of unmeasured load per scenario")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections (default 32)")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads (default 1: 2-core machine)")
    parser.add_argument("--rollouts", type=int, default=32, help="distinct trace_ids per run (default 32)")
    parser.add_argument("--rate", type=float, default=50.0, help="steady rate in req/s (0 to skip)")
    parser.add_argument("--rate-duration", type=float, default=10.0, help="seconds per steady-rate run")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between runs")
    parser.add_argument("--pg-admin-url", default=os.environ.get("BENCH_PG_ADMIN_URL", DEFAULT_PG_ADMIN))
    parser.add_argument("--redis-url", default=os.environ.get("BENCH_REDIS_URL", DEFAULT_REDIS))
    parser.add_argument("--results-dir", type=Path, default=BENCH_DIR / "results")
    parser.add_argument("--keep", action="store_true", help="keep the database, Redis keys and temp files")
    parser.add_argument(
        "--serve-env",
        action="append",
        default=[],
        metavar="SPARRING_X=VALUE",
        help="a setting of the retail scenarios' `sparring serve` (e.g. SPARRING_ACCESS_LOG=true)",
    )
    parser.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="SCENARIO",
        help="after the rounds, one extra run of SCENARIO under py-spy (needs py-spy on PATH)",
    )
    parser.add_argument("--profile-format", choices=["flamegraph", "speedscope", "raw"], default="flamegraph")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(unknown)}")
    if not names:
        parser.error("no scenario selected")
    bad_profile = [n for n in args.profile if n not in names]
    if bad_profile:
        parser.error(f"--profile names a scenario that is not run: {', '.join(bad_profile)}")
    if args.rounds < 1 or args.duration < 1 or args.connections < 1 or args.rollouts < 1:
        parser.error("--rounds, --duration, --connections and --rollouts must be positive")
    for url in (args.pg_admin_url, args.redis_url):
        host = httpx.URL(url.replace("postgresql+asyncpg", "postgresql")).host
        if host not in ("127.0.0.1", "localhost", "::1"):
            parser.error(f"only loopback services are used: {url}")
    # A fixed order; a subject's own baseline (echo-t2) comes with it when the echo is run.
    paired = {SCENARIOS[n].baseline for n in names} if BASELINE in names else set()
    args.scenario_list = [n for n in SCENARIOS if n in names or n in paired]
    for item in args.serve_env:
        if not re.match(r"^SPARRING_[A-Z0-9_]+=", item):
            parser.error(f"--serve-env takes SPARRING_NAME=value: {item}")
    return args


@contextmanager
def running(servers: dict[str, Server], ready_timeout: float = 60.0) -> Iterator[None]:
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready(ready_timeout)
            print(f"server {server.name:<18} pid {server.pid:<7} {server.url}", flush=True)
        yield
    finally:
        for server in servers.values():
            server.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wrk = shutil.which("wrk")
    if wrk is None:
        print("error: wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    py_spy = shutil.which("py-spy") if args.profile else None
    if args.profile and py_spy is None:
        print(
            "error: --profile needs py-spy on PATH (pip install py-spy, in a throwaway venv)", file=sys.stderr
        )
        return 2

    names: list[str] = args.scenario_list
    needed = {SCENARIOS[n].server for n in names}
    api_key = "bench-" + secrets.token_urlsafe(18)
    started = datetime.now(UTC)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    env = Environment(
        workdir=Path(tempfile.mkdtemp(prefix="sparring-bench-")),
        pg_admin_url=args.pg_admin_url,
        redis_url=args.redis_url,
        keep=args.keep,
    )
    info = machine_info()
    try:
        if needed & {"naive", "sparring-pg", "sparring-serve"}:
            env.create_postgres()
        if "sparring-serve" in needed:
            env.retail_data = retail_data_dir()
        if "sparring-embedded" in needed:
            env.create_sqlite()
        servers = build_servers(needed, env, api_key, args.serve_env)
        bench = Bench(args, servers, wrk, api_key, env.pg_database)
        if env.retail_data is not None:
            bench.ids_files = retail_ids(env.retail_data, env.workdir)
            bench.ids = {kind: path.read_text().split() for kind, path in bench.ids_files.items()}
        profiles: list[str] = []
        with running(servers):
            bench.run()
            if py_spy is not None:
                args.results_dir.mkdir(parents=True, exist_ok=True)
                for name in args.profile:
                    profiles.append(
                        str(bench.profile(name, py_spy, args.results_dir, stamp, args.profile_format))
                    )
        log_counts = env.log_counts()  # after the servers stopped: their logs are drained
    finally:
        env.teardown()

    rows = summarize(bench.records, args)
    answered = {row["scenario"]: row["answered_2xx"] for row in rows}
    checks = log_check(answered, log_counts)
    print()
    print(
        f"{args.rounds} rounds, {args.duration} s per wrk run, {args.connections} connections, "
        f"{args.rollouts} rollouts (retail-*: `sparring serve`, 500 rollouts, wrk -t2, paired with "
        f"echo-t2); medians. 'x echo': rate / rate of the echo run just before it; "
        "'CPU x echo': echo's server CPU per call / this server's (the ratio if each were CPU-bound)"
    )
    print(table(rows, args))
    for line in mcp_lines(rows):
        print(line)
    for line in checks:
        print(line)

    result: dict[str, Any] = {
        "started_at": started.isoformat(),
        "finished_at": datetime.now(UTC).isoformat(),
        "machine": info,
        "config": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "scenario_list"
        },
        "uvicorn": UVICORN_FLAGS,
        "summary": rows,
        "log_rows": log_counts,
        "log_checks": checks,
        "profiles": profiles,
        "runs": {
            name: {
                "wrk": [vars(r) for r in record.wrk],
                "ratios": record.ratios,
                "cpu_ratios": record.cpu_ratios,
                "steady": [r.as_dict() for r in record.rate],
            }
            for name, record in bench.records.items()
        },
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"bench-{stamp}.json"
    out.write_text(json.dumps(finite(result), indent=2))
    print(f"\nresults: {out}")
    return 0


def log_check(answered: dict[str, int], counts: dict[str, dict[str, Any]]) -> list[str]:
    """Every call answered with 2xx must be in the durable log (in-flight calls at wrk's end add rows)."""
    lines = []
    where: dict[str, tuple[str, str]] = {
        "trivial-pg": ("sparring-pg", "echo"),
        "full-pg": ("sparring-pg", "bump"),
        "mcp-trivial-pg": ("sparring-pg", "echo"),
        "mcp-full-pg": ("sparring-pg", "bump"),
        "trivial-embedded": ("sparring-embedded", "echo"),
        "full-embedded": ("sparring-embedded", "bump"),
        "mcp-trivial-embedded": ("sparring-embedded", "echo"),
        # `sparring serve` logs into the same database as sparring-pg.
        "retail-read": ("sparring-pg", "get_order_details"),
        "retail-write": ("sparring-pg", "modify_user_address"),
    }
    by_server: dict[tuple[str, str], int] = {}
    for name, key in where.items():
        if name in answered:
            by_server[key] = by_server.get(key, 0) + answered[name]
    for (server, tool), count in by_server.items():
        logged = sum(counts.get(server, {}).get(tool, {}).values())
        ok = logged >= count
        lines.append(
            f"log check {server}/{tool}: {logged} rows logged for {count} answered by the measured runs "
            f"(plus smoke, warm-up and in-flight calls): {'ok' if ok else 'MISSING ROWS'}"
        )
    return lines


def finite(value: Any) -> Any:
    """JSON without NaN: a missing measurement is null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


if __name__ == "__main__":
    raise SystemExit(main())
