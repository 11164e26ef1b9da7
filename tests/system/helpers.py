"""Process management for the system tests: servers, throwaway Redis and Postgres, and a load client.

Everything here binds loopback addresses only, bounds every wait, and stops what it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from tests.call_log import logged_calls_on
from tests.conftest import API_KEYS, REDIS_KEY_PREFIX, TOOLS_KEY

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
PACK_MODULE = "tests.system.serverpack"
BASE_VALUE = 100  # the counter pack's base value
TOOLS_HEADERS = {"Authorization": f"Bearer {TOOLS_KEY}"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((HOST, port)) == 0


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def clean_env(**settings: str) -> dict[str, str]:
    """The parent's environment without any SPARRING_ setting, plus these settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SPARRING_") and k not in ("PROMETHEUS_MULTIPROC_DIR", "PYTEST_CURRENT_TEST")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(settings)
    return env


def server_settings(
    *, database_url: str, redis_url: str | None, home: Path, worker: str, **extra: str
) -> dict[str, str]:
    settings = {
        "SPARRING_DATABASE_URL": database_url,
        "SPARRING_API_KEYS": API_KEYS,
        "SPARRING_PACKS": PACK_MODULE,
        "SPARRING_HOME": str(home),
        "SPARRING_WORKER_NAME": worker,
        # A crashed worker's lock lapses quickly, and a stuck call gives up well within the tests.
        "SPARRING_LOCK_TIMEOUT_SECONDS": "3",
        "SPARRING_TOOL_TIMEOUT_SECONDS": "10",
    }
    if redis_url is not None:
        settings["SPARRING_REDIS_URL"] = redis_url
        settings["SPARRING_REDIS_KEY_PREFIX"] = REDIS_KEY_PREFIX
    settings.update(extra)
    return settings


def terminate(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within 15 s."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


class Server:
    """One sparring server process (uvicorn, one worker) on a free loopback port."""

    def __init__(self, name: str, settings: dict[str, str], log_dir: Path, *, cli: bool = False) -> None:
        self.name = name
        self.port = free_port()
        self.settings = settings
        self.cli = cli
        self.log_path = log_dir / f"server-{name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        if self.cli:
            sparring = Path(sys.executable).with_name("sparring")
            return [str(sparring), "serve", "--host", HOST, "--port", str(self.port)]
        return [
            sys.executable,
            "-m",
            "uvicorn",
            "app.main:create_app",
            "--factory",
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            "--timeout-graceful-shutdown",
            "3",
        ]

    def start(self) -> Server:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                cwd=ROOT,
                env=clean_env(**self.settings),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def output(self) -> str:
        return _tail(self.log_path)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    async def wait_ready(self, limit: float = 30.0) -> None:
        deadline = time.monotonic() + limit
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                code = self.exited()
                if code is not None:
                    raise RuntimeError(f"server {self.name} exited with {code}:\n{self.output}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/healthz")).status_code == 200:
                        return
                await asyncio.sleep(0.1)
        raise TimeoutError(f"server {self.name} not ready after {limit:g} s:\n{self.output}")

    async def wait_exit(self, limit: float = 30.0) -> int:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            code = self.exited()
            if code is not None:
                return code
            await asyncio.sleep(0.1)
        raise TimeoutError(f"server {self.name} still running after {limit:g} s:\n{self.output}")

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, nothing is flushed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        terminate(self.proc)


class Servers:
    """Starts servers for one test and stops every one of them at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Server] = []

    async def start(self, name: str, settings: dict[str, str], *, cli: bool = False) -> Server:
        server = Server(name, settings, self.log_dir, cli=cli).start()
        self.started.append(server)
        await server.wait_ready()
        return server

    def launch(self, name: str, settings: dict[str, str], *, cli: bool = False) -> Server:
        """Start without waiting for readiness (for servers expected to refuse to start)."""
        server = Server(name, settings, self.log_dir, cli=cli).start()
        self.started.append(server)
        return server

    def stop_all(self) -> None:
        for server in self.started:
            server.stop()


# --- throwaway Redis --------------------------------------------------------------------------------


class ThrowawayRedis:
    """A redis-server on its own port with an append-only file, so a stop and restart keeps the data."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="sparring-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self, timeout: float = 15.0) -> None:
        with (self.dir / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(self.port),
                    "--bind",
                    HOST,
                    "--dir",
                    str(self.dir),
                    "--save",
                    "",
                    "--appendonly",
                    "yes",
                    "--appendfsync",
                    "always",
                    "--protected-mode",
                    "no",
                    "--loglevel",
                    "warning",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited:\n{_tail(self.dir / 'redis.log')}")
            if _port_open(self.port):
                return
            time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def stop(self) -> None:
        """SIGTERM: Redis syncs its append-only file and exits."""
        terminate(self.proc)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# --- throwaway Postgres -----------------------------------------------------------------------------

PG_BIN = Path("/usr/lib/postgresql/15/bin")


class ThrowawayPostgres:
    """A private Postgres cluster (initdb into a temp dir) on its own loopback port and socket dir."""

    def __init__(self) -> None:
        self.port = free_port()
        self.base = Path(tempfile.mkdtemp(prefix="sparring-pg-"))
        self.data = self.base / "data"
        self.sockets = self.base / "sock"
        self.log = self.base / "postgres.log"
        self._as_root = os.geteuid() == 0

    def admin_url(self, database: str = "postgres") -> str:
        return f"postgresql+asyncpg://postgres@{HOST}:{self.port}/{database}"

    def _run(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        command = [str(PG_BIN / args[0]), *args[1:]]
        if self._as_root:  # initdb and postgres refuse to run as root
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}\n"
                f"{_tail(self.log)}"
            )
        return result

    def init(self) -> None:
        self.sockets.mkdir()
        if self._as_root:
            user = pwd.getpwnam("postgres")
            for path in (self.base, self.sockets):
                os.chown(path, user.pw_uid, user.pw_gid)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.sockets} -c listen_addresses={HOST} -c fsync=off"
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "30", "start"
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def cleanup(self) -> None:
        if self.running():
            with contextlib.suppress(Exception):
                self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)

    async def create_database(self, name: str) -> str:
        engine = create_async_engine(self.admin_url(), isolation_level="AUTOCOMMIT", poolclass=NullPool)
        async with engine.connect() as conn:
            await conn.execute(text(f'CREATE DATABASE "{name}"'))
        await engine.dispose()
        return self.admin_url(name)


# --- reading the call log ---------------------------------------------------------------------------


async def logged_calls(database_url: str, traces: Iterable[str]) -> list[dict[str, Any]]:
    """tool_calls rows of these rollouts (a fresh engine: the test does not share the server's)."""
    engine = create_async_engine(database_url, poolclass=NullPool)
    try:
        return await logged_calls_on(engine, traces)
    finally:
        await engine.dispose()


# --- the load client --------------------------------------------------------------------------------


def counter_output(value: int) -> str:
    return orjson.dumps({"value": value}).decode()


def new_trace() -> str:
    return f"trace_{uuid.uuid4().hex}"


@dataclass
class Attempt:
    trace_id: str
    call_id: str
    url: str
    sent: float  # time.monotonic()
    received: float
    status: int | None  # None: no HTTP answer (connection refused or reset, timeout)
    output: str | None = None
    retry_after: str | None = None
    error: str | None = None


@dataclass
class RolloutProgress:
    trace_id: str
    answered: int = 0  # calls answered with 200, in order
    pending: str | None = None  # a call sent but never answered with 200 (its effect is unknown)
    done: bool = False


@dataclass
class CounterLoad:
    """Rollouts of sequential `increment` calls (by 1), retried like the trainer retries a 5xx.

    The k-th call of a rollout must answer base + k + 1, whichever server answers it and however
    often it was retried: any other 200 is a lost or doubled update, or an answer that pretends.
    """

    urls: list[str]
    workers: int = 12
    calls_per_rollout: int = 8
    max_attempts: int = 80
    request_timeout: float = 20.0
    pause: float = 0.1
    attempts: list[Attempt] = field(default_factory=list)
    answers: dict[tuple[str, str], Attempt] = field(default_factory=dict)
    rollouts: dict[str, RolloutProgress] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]

    async def stop(self, grace: float = 5.0) -> None:
        """Stop starting calls; let those in flight finish for `grace` seconds, then cancel them."""
        self._stop.set()
        _, pending = await asyncio.wait(self._tasks, timeout=grace)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for task in self._tasks:
            if not task.cancelled() and task.exception() is not None:
                self.violations.append(f"load worker failed: {task.exception()!r}")

    async def wait_for(self, predicate: Callable[[], bool], limit: float, what: str) -> None:
        deadline = time.monotonic() + limit
        while not predicate():
            if self.violations:
                raise AssertionError(f"while waiting for {what}: {self.violations[:5]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {limit:g} s waiting for {what}")
            await asyncio.sleep(0.05)

    def answered_since(self, moment: float, url: str | None = None) -> int:
        return sum(1 for a in self.answers.values() if a.sent >= moment and (url is None or a.url == url))

    def statuses_since(self, moment: float, status: int | None) -> int:
        return sum(1 for a in self.attempts if a.sent >= moment and a.status == status)

    def within(self, start: float, end: float) -> list[Attempt]:
        """Attempts sent after `start` and answered before `end`."""
        return [a for a in self.attempts if a.sent >= start and a.received <= end]

    async def _worker(self, index: int) -> None:
        async with httpx.AsyncClient(headers=TOOLS_HEADERS, timeout=self.request_timeout) as client:
            while not self._stop.is_set():
                progress = RolloutProgress(new_trace())
                self.rollouts[progress.trace_id] = progress
                for k in range(self.calls_per_rollout):
                    if self._stop.is_set() or not await self._call(client, progress, k, index):
                        break
                else:
                    progress.done = True

    async def _call(self, client: httpx.AsyncClient, progress: RolloutProgress, k: int, index: int) -> bool:
        call_id = f"call_{k}"
        progress.pending = call_id
        body = {
            "type": "function_call",
            "id": f"fc_{k}",
            "call_id": call_id,
            "name": "increment",
            "arguments": '{"by": 1}',
            "trace_id": progress.trace_id,
            "item": {"id": progress.trace_id},
        }
        for attempt in range(self.max_attempts):
            url = self.urls[(index + k + attempt) % len(self.urls)]
            sent = time.monotonic()
            try:
                response = await client.post(f"{url}/tools/increment", json=body)
            except httpx.HTTPError as exc:
                self.attempts.append(
                    Attempt(progress.trace_id, call_id, url, sent, time.monotonic(), None, error=repr(exc))
                )
            else:
                record = Attempt(
                    progress.trace_id,
                    call_id,
                    url,
                    sent,
                    time.monotonic(),
                    response.status_code,
                    retry_after=response.headers.get("Retry-After"),
                )
                self.attempts.append(record)
                if response.status_code == 200:
                    record.output = response.json().get("output")
                    expected = counter_output(BASE_VALUE + k + 1)
                    if record.output != expected:
                        self.violations.append(
                            f"{progress.trace_id} {call_id} via {url}: answered {record.output}, "
                            f"expected {expected}"
                        )
                    self.answers[(progress.trace_id, call_id)] = record
                    progress.answered += 1
                    progress.pending = None
                    return True
                if response.status_code != 503:
                    self.violations.append(
                        f"{progress.trace_id} {call_id} via {url}: "
                        f"{response.status_code} {response.text[:300]}"
                    )
                    return False
                if not record.retry_after:
                    self.violations.append(f"{progress.trace_id} {call_id}: 503 without Retry-After")
            if self._stop.is_set():
                return False
            await asyncio.sleep(self.pause)
        return False  # the trainer would discard this rollout

    def check_log(self, rows: list[dict[str, Any]]) -> list[str]:
        """Every 200 answer is in the log once, answered, with the output that was sent; no other."""
        problems: list[str] = []
        answered_rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for row in rows:
            if row["status_code"] == 200 and row["call_id"] is not None:
                answered_rows.setdefault((row["trace_id"], row["call_id"]), []).append(row)
        for key, attempt in self.answers.items():
            found = answered_rows.get(key, [])
            if len(found) != 1:
                problems.append(
                    f"{key} answered {attempt.output} via {attempt.url}: {len(found)} rows in the log"
                )
            elif found[0]["output"] != attempt.output:
                problems.append(f"{key}: sent {attempt.output}, logged {found[0]['output']}")
        # And nothing is logged as answered that was never sent, but for the one call of a rollout
        # whose fate is unknown (in flight when the load stopped).
        pending = {(p.trace_id, p.pending) for p in self.rollouts.values() if p.pending is not None}
        for key, found in answered_rows.items():
            if key not in self.answers and key not in pending:
                problems.append(f"{key}: logged as answered ({found[0]['output']}) but never sent")
        return problems

    async def check_counters(self, url: str) -> list[str]:
        """Each rollout's counter is base + its answered calls (+1 at most for a call of unknown fate)."""
        problems: list[str] = []
        async with httpx.AsyncClient(headers=TOOLS_HEADERS, timeout=self.request_timeout) as client:
            for progress in self.rollouts.values():
                response = await client.post(
                    f"{url}/tools/read_counter",
                    json={"arguments": "{}", "trace_id": progress.trace_id},
                )
                if response.status_code != 200:
                    problems.append(f"{progress.trace_id}: read_counter {response.status_code}")
                    continue
                value = orjson.loads(response.json()["output"])["value"]
                allowed = {BASE_VALUE + progress.answered}
                if progress.pending is not None:
                    allowed.add(BASE_VALUE + progress.answered + 1)
                if value not in allowed:
                    problems.append(
                        f"{progress.trace_id}: counter {value}, answered {progress.answered} "
                        f"(pending {progress.pending}), allowed {sorted(allowed)}"
                    )
        return problems
