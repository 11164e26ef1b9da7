"""Capping a run's memory across all its processes: a cgroup (v2 or v1) per run, else per-process rlimits.

Which mechanism works is found once, at start-up, by making this worker's cgroup and a run's cgroup in it
and setting the limit; the first that works is used and named in the start-up log. A worker's cgroups are
named after its pid and start time, so one starting later removes those of workers that are gone.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger("sparring.packs.code.sandbox")

Mechanism = Literal["cgroup-v2", "cgroup-v1", "rlimit"]
CGROUP_MOUNT = Path("/sys/fs/cgroup")
_WORKER_DIR = re.compile(r"sparring-(\d+)-(\d+)")


def stat_fields(pid: int) -> list[str]:
    """The fields of `/proc/<pid>/stat` after the command name (the state first); empty when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_identity(pid: int) -> str | None:
    """`<pid>-<start time>` of a live process (a reused pid gets another start time), else None."""
    fields = stat_fields(pid)
    return f"{pid}-{fields[19]}" if len(fields) > 19 else None


def owner_alive(name: str) -> bool:
    """True if the worker a `...-<pid>-<start time>` name belongs to still runs."""
    match = re.search(r"(\d+)-(\d+)$", name)
    return match is not None and process_identity(int(match.group(1))) == f"{match.group(1)}-{match.group(2)}"


def own_cgroup(controller: str | None) -> str | None:
    """This process's cgroup path in the hierarchy of `controller` (None: the unified, v2 one)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",") if controllers else []
        if (controller is None and not names) or (controller is not None and controller in names):
            return path
    return None


@dataclass
class MemoryCap:
    """Makes a cgroup with a memory limit for each run, or (mechanism `rlimit`) nothing."""

    mechanism: Mechanism
    worker: Path | None = None  # this worker's cgroup, holding one cgroup per run

    @property
    def per_run(self) -> bool:
        return self.worker is not None

    def new_group(self, memory_bytes: int) -> Path | None:
        """A fresh cgroup limited to `memory_bytes` (swap included), or None without a cgroup mechanism."""
        if self.worker is None:
            return None
        group = self.worker / f"run-{uuid.uuid4().hex[:12]}"
        group.mkdir()
        try:
            if self.mechanism == "cgroup-v2":
                (group / "memory.max").write_text(str(memory_bytes))
                _write_if_present(group / "memory.swap.max", "0")
            else:
                (group / "memory.limit_in_bytes").write_text(str(memory_bytes))
                _write_if_present(group / "memory.memsw.limit_in_bytes", str(memory_bytes))
        except OSError:
            release(group)
            raise
        return group

    def oom_kills(self, group: Path) -> int:
        """How many processes of `group` the kernel has killed for going over its limit, so far."""
        try:
            return _oom_kill_count((group / self.events_file).read_text())
        except OSError:
            return 0

    @property
    def events_file(self) -> str:
        """The group's file that counts its out-of-memory kills (`oom_kill`)."""
        return "memory.events" if self.mechanism == "cgroup-v2" else "memory.oom_control"

    def open_events(self, group: Path) -> int:
        """A descriptor of `group`'s events file, for `oom_kills_at` (-1 where it cannot be opened)."""
        try:
            return os.open(group / self.events_file, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1

    @staticmethod
    def oom_kills_at(fd: int) -> int:
        """`oom_kills` through a descriptor kept open (a read from offset 0 regenerates the file): what
        a warm run reads twice, without opening a cgroup file on the event loop each time."""
        try:
            return _oom_kill_count(os.pread(fd, 4096, 0).decode())
        except (OSError, UnicodeDecodeError):
            return 0

    def out_of_memory(self, group: Path) -> bool:
        """True if the kernel killed a process of `group` for going over its limit."""
        name = "memory.events" if self.mechanism == "cgroup-v2" else "memory.oom_control"
        try:
            for line in (group / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip() not in ("", "0"):
                    return True
        except OSError:
            pass
        return False


def _write_if_present(path: Path, value: str) -> None:
    if path.exists():
        path.write_text(value)


def release(group: Path) -> None:
    """Kill what is left in `group` and remove it; never raises (a group left over is swept later)."""
    for _ in range(100):
        try:
            pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            pids = []
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)  # killed processes take a moment to leave the group
    log.warning("could not remove the cgroup %s (it is swept at the next start)", group)


def sweep(parent: Path, workers: re.Pattern[str] = _WORKER_DIR) -> None:
    """Remove the cgroups of workers that are gone (a killed worker leaves its runs' cgroups): those in
    `parent` whose names `workers` matches, ending in the worker's pid and start time."""
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            if entry.is_dir() and workers.fullmatch(entry.name) and not owner_alive(entry.name):
                with contextlib.suppress(OSError):
                    for run in entry.iterdir():
                        if run.is_dir():
                            release(run)
                release(entry)


def _try_v2(identity: str) -> MemoryCap:
    own = own_cgroup(None)
    if own is None or not (CGROUP_MOUNT / "cgroup.controllers").is_file():
        raise OSError("no cgroup v2 hierarchy")
    # Runs' cgroups go in this process's cgroup, or beside it (a delegated cgroup whose processes live in
    # a leaf: a cgroup holding processes cannot give controllers to children of its own).
    here = CGROUP_MOUNT / own.lstrip("/")
    failures = []
    for parent in (here, here.parent):
        try:
            if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                (parent / "cgroup.subtree_control").write_text("+memory")
        except OSError as exc:
            failures.append(f"{parent}: {exc.strerror or exc}")
            continue
        sweep(parent)
        worker = parent / f"sparring-{identity}"
        worker.mkdir(exist_ok=True)
        try:
            (worker / "cgroup.subtree_control").write_text("+memory")
        except OSError:
            release(worker)
            raise
        return MemoryCap("cgroup-v2", worker)
    raise OSError("the memory controller is not delegated (" + "; ".join(failures) + ")")


def _try_v1(identity: str) -> MemoryCap:
    own = own_cgroup("memory")
    root = CGROUP_MOUNT / "memory"
    if own is None or not (root / "memory.limit_in_bytes").is_file():
        raise OSError("no cgroup v1 memory controller")
    parent = root / own.lstrip("/")
    sweep(parent)
    worker = parent / f"sparring-{identity}"
    worker.mkdir(exist_ok=True)
    return MemoryCap("cgroup-v1", worker)


_removed_at_exit: set[Path] = set()


def detect(memory_bytes: int) -> tuple[MemoryCap, str]:
    """The first mechanism that works here, and why the others did not (empty when a cgroup works)."""
    identity = process_identity(os.getpid()) or f"{os.getpid()}-0"
    reasons = []
    for name, attempt in (("cgroup v2", _try_v2), ("cgroup v1", _try_v1)):
        try:
            cap = attempt(identity)
            release(_checked(cap, memory_bytes))
            if cap.worker is not None and cap.worker not in _removed_at_exit:
                # Shared by every sandbox this process builds: removed when the process ends.
                _removed_at_exit.add(cap.worker)
                atexit.register(release, cap.worker)
            return cap, ""
        except (OSError, ValueError) as exc:
            reasons.append(f"{name}: {exc}")
    return MemoryCap("rlimit"), "; ".join(reasons)


def _checked(cap: MemoryCap, memory_bytes: int) -> Path:
    group = cap.new_group(memory_bytes)
    assert group is not None
    if not (group / "cgroup.procs").is_file():
        raise OSError(f"{group} has no cgroup.procs")
    return group


def _oom_kill_count(events: str) -> int:
    for line in events.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            try:
                return int(value.strip() or 0)
            except ValueError:
                return 0
    return 0
