"""A real local Redis Cluster for the tests: three `redis-server --cluster-enabled yes` shards, no replicas.

`LocalCluster` starts the servers on free ports in a temporary directory, joins them with
`redis-cli --cluster create`, waits until every node reports `cluster_state:ok`, and stops them all
when it is closed. The fault tests stop, pause and resume one shard.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SHARDS = 3


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        port = random.randrange(20000, 55000)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free pair of ports for a Redis Cluster node")


def _cli(port: int, *args: str) -> str:
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    return done.stdout


@dataclass
class LocalCluster:
    root: Path
    # An append-only file fsynced on every write: a shard killed and started again comes back with its data.
    persist: bool = False
    ports: list[int] = field(default_factory=list)
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """The seed node's URL (the first shard), as SPARRING_REDIS_URL gives it."""
        return f"redis://127.0.0.1:{self.ports[0]}"

    def start_node(self, port: int) -> None:
        node_dir = self.root / str(port)
        node_dir.mkdir(exist_ok=True)
        self.processes[port] = subprocess.Popen(
            [
                "redis-server",
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--dir", str(node_dir),
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000",
                # A lost shard stops only its own slots (the others' rollouts go on).
                "--cluster-require-full-coverage", "no",
                "--save", "",
                "--appendonly", "yes" if self.persist else "no",
                "--appendfsync", "always",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait(lambda: _answers(port), f"redis-server on port {port}")

    def restart_node(self, port: int) -> None:
        """Start a stopped shard again on its port (it rejoins with its node file)."""
        self.start_node(port)
        self.wait_ok()

    def node_id(self, port: int) -> str:
        return _cli(port, "CLUSTER", "MYID").strip()

    def move_slot(self, slot: int, source: int, target: int, *, finish: bool = True) -> None:
        """Move a slot and its keys between shards as `redis-cli --cluster reshard` does; with `finish`
        False the slot stays half-moved (keys on the target, source MIGRATING), so clients meet ASK."""
        source_id, target_id = self.node_id(source), self.node_id(target)
        _cli(target, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
        _cli(source, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)
        while keys := _cli(source, "CLUSTER", "GETKEYSINSLOT", str(slot), "100").split():
            _cli(source, "MIGRATE", "127.0.0.1", str(target), "", "0", "5000", "KEYS", *keys)
        if finish:
            self.finish_move(slot, target)

    def finish_move(self, slot: int, target: int) -> None:
        target_id = self.node_id(target)
        for port in self.ports:
            _cli(port, "CLUSTER", "SETSLOT", str(slot), "NODE", target_id)

    def stop_node(self, port: int) -> None:
        process = self.processes.pop(port)
        process.kill()
        process.wait(timeout=10)

    def pause_node(self, port: int) -> None:
        os.kill(self.processes[port].pid, signal.SIGSTOP)

    def resume_node(self, port: int) -> None:
        os.kill(self.processes[port].pid, signal.SIGCONT)

    @property
    def _live_port(self) -> int:
        return next(iter(self.processes))

    def slot_of(self, key: str) -> int:
        return int(_cli(self._live_port, "CLUSTER", "KEYSLOT", key).strip())

    def port_of_key(self, key: str) -> int:
        """The port of the shard that holds `key`'s slot."""
        slot = self.slot_of(key)
        for line in _cli(self._live_port, "CLUSTER", "NODES").splitlines():
            fields = line.split()
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            for part in fields[8:]:
                low, _, high = part.partition("-")
                if not low.startswith("[") and int(low) <= slot <= int(high or low):
                    return port
        raise LookupError(f"no shard holds slot {slot}")

    def wait_ok(self) -> None:
        for port in self.processes:
            _wait(lambda port=port: "cluster_state:ok" in _cli(port, "CLUSTER", "INFO"), "cluster_state:ok")

    def close(self) -> None:
        for port in list(self.processes):
            self.resume_node(port)
            self.stop_node(port)
        shutil.rmtree(self.root, ignore_errors=True)


def _answers(port: int) -> bool:
    try:
        return _cli(port, "PING").strip() == "PONG"
    except subprocess.SubprocessError:
        return False


def _wait(ready: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


@contextmanager
def local_cluster(*, persist: bool = False) -> Iterator[LocalCluster]:
    """A running three-shard cluster; skips the test where redis-server or redis-cli is missing."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("needs redis-server and redis-cli (Debian's redis-server package)")
    cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="sparring-cluster-")), persist=persist)
    try:
        for _ in range(SHARDS):
            port = _free_port()
            cluster.ports.append(port)
            cluster.start_node(port)
        nodes = [f"127.0.0.1:{port}" for port in cluster.ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            timeout=60,
            check=True,
        )
        cluster.wait_ok()
        yield cluster
    finally:
        cluster.close()
