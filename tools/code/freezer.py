"""Stopping an interpreter's processes between its requests: the kernel's cgroup freezer, else signals.

A session of the `python` tool (its driver and whatever its cells left running) is stopped a moment
after each answer and continued with its next request (`Session.freeze_later`). The cgroup v2 freezer
(`cgroup.freeze`, Linux 5.2+) stops every process of a cgroup at once, and those they fork after, and
nothing a process of the cgroup does undoes it: a SIGCONT from another one, a timer that sends one, a
ptrace of bwrap's pid 1. Where each session's memory cgroup is a v2 one, its own `cgroup.freeze` is used
(`memory-cgroup`); where the memory cgroup is v1 or there is none, but a v2 hierarchy this server may
write is mounted (on a hybrid host, at /sys/fs/cgroup/unified, holding no controller), each session gets
a v2 cgroup of its own for the freezer alone (`own-cgroup`), in a cgroup of this worker's named after its
pid namespace, pid and start time: a server starting later sweeps those of workers gone from its own pid
namespace, never another's (servers in other pid namespaces may share that hierarchy's root). Without
either, each process of the session is stopped by SIGSTOP and checked again for a moment (`signals`,
needing the memory cgroup's list of processes): processes that continue each other are caught, a cell
that makes the kernel or a process it controls send SIGCONT can escape it, and the start-up log says so.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tools.code import memory
from tools.code.memory import CGROUP_MOUNT, MemoryCap, own_cgroup, process_identity, release

Mechanism = Literal["memory-cgroup", "own-cgroup", "signals"]
FREEZE_FILE = "cgroup.freeze"


@dataclass
class Freezer:
    """How sessions are stopped between requests, and where their own freezer cgroups go."""

    mechanism: Mechanism
    worker: Path | None = None  # own-cgroup: this worker's v2 cgroup, holding one cgroup per session

    def new_group(self) -> Path | None:
        """A fresh v2 cgroup for one session's freezer (`own-cgroup`), else None."""
        if self.mechanism != "own-cgroup" or self.worker is None:
            return None
        group = self.worker / f"session-{uuid.uuid4().hex[:12]}"
        group.mkdir()
        return group

    def freeze_file(self, memory_group: Path | None, own_group: Path | None) -> Path | None:
        """The `cgroup.freeze` of a session with these cgroups, or None (stopped by signals)."""
        if self.mechanism == "memory-cgroup" and memory_group is not None:
            return memory_group / FREEZE_FILE
        if self.mechanism == "own-cgroup" and own_group is not None:
            return own_group / FREEZE_FILE
        return None


def v2_root() -> Path | None:
    """Where the v2 hierarchy is mounted: /sys/fs/cgroup (v2 alone) or /sys/fs/cgroup/unified (hybrid)."""
    for root in (CGROUP_MOUNT, CGROUP_MOUNT / "unified"):
        if (root / "cgroup.controllers").is_file():
            return root
    return None


def _works(group: Path) -> None:
    """Freeze and thaw `group` (empty) once; OSError if its freezer is missing or refuses."""
    path = group / FREEZE_FILE
    if not path.is_file():
        raise OSError(f"{path} is missing (the v2 freezer needs Linux 5.2 or later)")
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, b"1")
        os.write(fd, b"0")
    finally:
        os.close(fd)


_removed_at_exit: set[Path] = set()


def pid_namespace() -> str:
    """This process's pid namespace (its inode), "0" where it cannot be read."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def worker_name(identity: str) -> str:
    """The name of the freezer cgroup of the worker `<pid>-<start time>` of this pid namespace."""
    return f"sparring-{pid_namespace()}-{identity}"


def sweep(parent: Path) -> None:
    """Remove the freezer cgroups of this pid namespace's workers that are gone (a killed worker leaves
    them); a pid of another namespace says nothing here, so theirs are left alone."""
    memory.sweep(parent, re.compile(rf"sparring-{pid_namespace()}-\d+-\d+"))


def detect(memory: MemoryCap) -> tuple[Freezer, str]:
    """The freezer sessions get here, and why a cgroup one could not be used (empty when it can)."""
    if memory.mechanism == "cgroup-v2" and memory.worker is not None:
        group = memory.new_group(64 * 1024 * 1024)
        assert group is not None
        try:
            _works(group)
            return Freezer("memory-cgroup"), ""
        except OSError as exc:
            reason = f"the memory cgroups' freezer: {exc}"
        finally:
            release(group)
        return Freezer("signals"), reason
    root, own = v2_root(), own_cgroup(None)
    if root is None or own is None:
        return Freezer("signals"), "no cgroup v2 hierarchy is mounted"
    parent = root / own.lstrip("/")
    identity = process_identity(os.getpid()) or f"{os.getpid()}-0"
    worker = parent / worker_name(identity)
    try:
        sweep(parent)
        worker.mkdir(exist_ok=True)
        group = worker / "probe"
        group.mkdir(exist_ok=True)
        try:
            _works(group)
        finally:
            release(group)
    except OSError as exc:
        with contextlib.suppress(OSError):
            worker.rmdir()
        return Freezer("signals"), f"cannot make a v2 cgroup under {parent}: {exc.strerror or exc}"
    if worker not in _removed_at_exit:
        _removed_at_exit.add(worker)
        atexit.register(release, worker)
    return Freezer("own-cgroup", worker), ""
