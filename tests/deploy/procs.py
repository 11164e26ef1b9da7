"""Processes started by the deployment tests: each in its own session, logged to a file, always ended."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def clean_env(**overrides: str) -> dict[str, str]:
    """The test's environment without any SPARRING_ setting of the developer's shell, plus overrides."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SPARRING_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(overrides)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise AssertionError(
                f"{self.name} exited with {self.popen.returncode}; its output:\n{self.output()[-4000:]}"
            )


class Processes:
    """Starts processes in new sessions and ends each of them (and only them) by its process group."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[Proc] = []

    def start(self, name: str, args: list[str], *, env: Mapping[str, str], cwd: Path = REPO) -> Proc:
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(env), cwd=cwd, start_new_session=True,
            )  # fmt: skip
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            stop(proc.popen)
        self.procs.clear()


def stop(popen: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM the process group this test started (the child leads it), then SIGKILL if it lingers."""
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, signal.SIGTERM)
            popen.wait(timeout=grace)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(timeout=grace)
    # Workers the leader forked may outlive it for a moment: end what is left of the group.
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def processes(logs: Path) -> Iterator[Processes]:
    procs = Processes(logs)
    try:
        yield procs
    finally:
        procs.stop_all()


def wait_http(url: str, proc: Proc, timeout: float = 30.0, **client: object) -> None:
    """Wait until `url` answers 200, failing early with the process's output if it dies."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        proc.check_alive()
        try:
            response = httpx.get(url, timeout=2.0, **client)  # type: ignore[arg-type]
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(
        f"{url} not up after {timeout}s ({last}); {proc.name} said:\n{proc.output()[-4000:]}"
    )


def wait_tcp(port: int, proc: Proc, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.check_alive()
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(
        f"port {port} not listening after {timeout}s; {proc.name} said:\n{proc.output()[-4000:]}"
    )
