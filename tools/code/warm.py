"""Warm, forked sandboxes: a parent started once per worker inside bwrap forks a child per run.

The parent (`harness_zygote.py`) is started like a cold run (bwrap with the same namespaces, mounts,
unprivileged uid and rlimits, in a memory cgroup of its own) with Python's imports done. It forks one
**slot** per run slot of the worker, each moved once into a memory cgroup of its own (a run is born in
its slot's cgroup: moving a process between cgroups costs a kernel-wide synchronization, ~10 ms) and
with a network namespace of its own (a loopback; its runs use it in turn); a slot runs one run at a
time. Each run is a fork of its slot, prepared while the slot waits: new user, mount, pid, ipc and uts
namespaces, fresh size-capped tmpfs at `/workspace`, `/tmp` and `/dev/shm`, its own `/proc`, no
capability; when its job arrives it writes the files, sets the run's rlimits and runs the program in a
fresh `__main__`. What a cold run gets, a warm run gets: only the cost of starting bwrap and Python is
gone. The slot's cgroup caps each of its runs (one at a time); an out-of-memory kill is the run's when
the cgroup's count of them moved during it.

The parent is restarted after `max_runs` runs (a fork shares the parent's hash seed, so that bounds how
many runs share one) and whenever it dies; the runs in flight when it dies are `SandboxUnavailable` (a
503 with Retry-After), never a result. Where it cannot start or cannot run a probe (a kernel without
user namespaces inside bwrap), the worker keeps the cold path and says why (`describe()`, `/healthz`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tools.code.memory import MemoryCap
from tools.code.memory import release as release_group
from tools.code.sandbox import (
    HARD_OUTPUT_BYTES,
    REPORT_GRACE_SECONDS,
    SETUP_GRACE_SECONDS,
    WORKSPACE_ARG,
    WORKSPACE_MOUNT,
    Limits,
    RunResult,
    SandboxUnavailable,
    _kill_group,
    _read_capped,
    _Run,
    harness_source,
    kill_process,
    parse_report,
    report_cap,
)

if TYPE_CHECKING:
    from tools.code.sandbox import Sandbox

log = logging.getLogger("sparring.packs.code.sandbox")

READY_SECONDS = 15.0  # bwrap's setup and the parent's imports
# A slot given back to an idle worker prepares its next run this much later, so the preparation (the
# clone, the mounts, the page copy: CPU on the worker's cores) does not compete with the answer of the
# run just made (its files kept, its call logged, its response sent). A run that comes sooner prepares
# its slot itself, as a run under concurrency does.
PREPARE_AFTER_SECONDS = 0.005
PARENT_GONE_SECONDS = 0.5  # how long a run whose socket closed early waits to learn that the parent died
# Slots an idle worker keeps beyond the one its last run used, each with its next run prepared: a run that
# comes right after another (a rollout's second call of one turn, a grade after the last call) takes a
# prepared one instead of waiting for the last run's end and then for its own clone (~7 ms against ~4 ms
# here, one call at a time with no pause). A slot costs a fork of the parent and its prepared run.
SPARE_SLOTS = 1
# The parent's own limits: a run lowers them to its own (it can never raise a hard limit).
PARENT_LIMITS = Limits(
    wall_seconds=0.0,
    cpu_seconds=10**9,
    processes=4096,
    open_files=4096,
    file_bytes=1 << 30,
)
TMP_BYTES = Limits().tmp_bytes  # every run's /tmp (a run asking for another size goes cold)
WARM_FLAGS = ("-I", "-B", "-X", "utf8")
# Sources the parent compiles once: a run of one of them (`-c SOURCE`: the grading harness; the runner it
# forks) execs the parent's code object instead of compiling it (2-4 ms of CPU per grade here).
PRECOMPILED = (
    "harness_main.py",
    "harness_runner.py",
)  # the parent's interpreter flags (a run's may differ: see `parse`)


@dataclass(frozen=True)
class Program:
    """What a run executes, read from its python arguments (None from `parse`: only cold can run it)."""

    isolated: bool
    code: str | None  # `-c CODE`
    argv: list[str]  # the script and its arguments, or the arguments after `-c CODE`


def parse(python_args: Sequence[str]) -> Program | None:
    """The warm path runs `[-I] [-E] [-s] [-B] [-X utf8] (-c CODE | PATH) ARGS...`; other flags go cold.

    The parent runs with `-I -B -X utf8` and site imported: a run without `-I` still gets its script's
    directory (or '' for `-c`) first on sys.path, as `python` gives it; `sys.flags` are the parent's.
    """
    isolated = False
    i = 0
    while i < len(python_args):
        arg = python_args[i]
        if arg == "-I":
            isolated = True
        elif arg in ("-E", "-s", "-B"):
            pass
        elif arg == "-X" and python_args[i + 1 : i + 2] == ["utf8"]:
            i += 1
        elif arg == "-c" and i + 1 < len(python_args):
            return Program(isolated, python_args[i + 1], list(python_args[i + 2 :]))
        elif arg and not arg.startswith("-"):
            return Program(isolated, None, list(python_args[i:]))
        else:
            return None
        i += 1
    return None


class Slot:
    """A fork of the parent that runs one run at a time, in a memory cgroup of its own; `ready` is the
    socket of its next run, prepared in advance."""

    def __init__(self, sock: socket.socket, group: Path | None) -> None:
        self.sock = sock
        self.group = group
        self.events = -1  # the group's events file, kept open (MemoryCap.oom_kills_at)
        self.ready: socket.socket | None = None
        # A slot is closed on the event loop (its parent retiring) and dropped in a worker thread (a run
        # that failed) at once: each descriptor and the group are given back exactly once. A descriptor
        # closed twice would close whatever took its number meanwhile (a new parent's socket).
        self._closing = threading.Lock()

    def oom_kills(self, memory: MemoryCap) -> int:
        """The kernel's out-of-memory kills in the slot's group so far (0 without a group)."""
        if self.group is None:
            return 0
        return memory.oom_kills_at(self.events) if self.events >= 0 else memory.oom_kills(self.group)

    def prepare(self, prefault: bool = False) -> None:
        """Have the slot fork the next run's namespaces now, so a run finds them made; with `prefault`,
        its program's process also copies the parent's pages while it waits (CPU spent ahead, and ~8 MiB more
        of the slot's memory cgroup, to take ~1.5 ms of page faults off the run; it stops when the job
        arrives)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            socket.send_fds(self.sock, [b"F" if prefault else b"N"], [theirs.fileno()])
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        ours.setblocking(False)
        self.ready = ours

    def close(self) -> None:
        with self._closing:
            events, self.events = self.events, -1
            ready, self.ready = self.ready, None
            if events >= 0:
                with contextlib.suppress(OSError):
                    os.close(events)
            for sock in (ready, self.sock):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()

    def take_group(self) -> Path | None:
        """The slot's memory cgroup, to remove: once (None afterwards)."""
        with self._closing:
            group, self.group = self.group, None
            return group


class Parent:
    """One started parent: its process (bwrap and the zygote in it), its control socket, its slots."""

    def __init__(self, process: asyncio.subprocess.Process, control: socket.socket, run: _Run) -> None:
        self.process = process
        self.control = control
        self.run = run  # what it holds on the host (its own cgroup)
        self.slots: list[Slot] = []  # every live slot
        self.free: list[Slot] = []
        self.runs = 0  # runs handed to it
        self.inflight = 0
        self.retiring = False
        self.deferred: asyncio.TimerHandle | None = None  # the free slots' preparation, when pending
        self.adding = False  # a spare slot being made
        self.rss_bytes = 0
        self.stderr = bytearray()
        self._watch = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        stream = self.process.stderr
        assert stream is not None
        while chunk := await stream.read(65536):
            self.stderr = (self.stderr + chunk)[-8192:]

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def died(self, within: float) -> bool:
        """True if the parent has ended (waiting up to `within` seconds to learn it)."""
        if self.process.returncode is not None:
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.process.wait()), within)
        return self.process.returncode is not None

    def said(self) -> str:
        lines = self.stderr.decode("utf-8", "replace").strip().splitlines()
        return lines[-1] if lines else ""

    def drop(self, slot: Slot) -> None:
        """Forget a slot that failed; its socket closes (the slot exits) and its cgroup is removed. Safe
        to run twice at once (a failed run's drop in a thread, the parent's close)."""
        slot.close()
        with contextlib.suppress(ValueError):
            self.slots.remove(slot)
        with contextlib.suppress(ValueError):
            self.free.remove(slot)
        group = slot.take_group()
        if group is not None:
            release_group(group)  # kills what is left in it (the slot itself)

    async def close(self) -> None:
        if self.deferred is not None:
            self.deferred.cancel()
            self.deferred = None
        with contextlib.suppress(OSError):
            self.control.close()
        for slot in list(self.slots):
            slot.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.process.wait()), 1.0)
        _kill_group(self.process.pid)
        kill_process(self.process)
        await self.process.wait()
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._watch, REPORT_GRACE_SECONDS)
        for slot in list(self.slots):
            await asyncio.to_thread(self.drop, slot)
        await asyncio.to_thread(self.run.release)


PathName = Literal["warm", "cold"]


class WarmRunner:
    """The worker's warm parent: started, restarted and retired here; `run` forks a child of it per run."""

    def __init__(self, sandbox: Sandbox, max_runs: int, spare_slots: int = SPARE_SLOTS) -> None:
        self.sandbox = sandbox
        self.max_runs = max_runs
        self.spare_slots = spare_slots
        self.path: PathName = "cold"
        self.why_cold = "not started"
        self.current: Parent | None = None
        self.started = 0  # parents started, the first included
        self.runs = 0
        self._lock = asyncio.Lock()
        self._background_work: set[asyncio.Future[None]] = set()  # closing parents

    def program(self, python_args: Sequence[str], limits: Limits) -> Program | None:
        """What a run of `python_args` executes on the warm path; None when it goes cold."""
        if self.path != "warm" or limits.tmp_bytes != TMP_BYTES:
            return None
        return parse(python_args)

    def describe(self) -> dict[str, Any]:
        """What /healthz says of the code sandbox."""
        info: dict[str, Any] = {"path": self.path, "warm_runs_per_parent": self.max_runs}
        if self.path == "cold":
            info["why_cold"] = self.why_cold
        else:
            info["warm_runs"] = self.runs
            info["parents_started"] = self.started
            if self.current is not None:
                info["parent_rss_bytes"] = self.current.rss_bytes  # at its start, imports done
                info["slots"] = len(self.current.slots)
        return info

    async def start(self) -> bool:
        """Start the parent and run a probe through it; False (the cold path, and why) if either fails."""
        try:
            probe = Program(isolated=True, code="import sys; print(sys.version_info[0])", argv=[])
            result = await self.run({}, probe, Limits())
            if result.exit_code != 0 or result.stdout.data.strip() != b"3":
                detail = (result.stderr.data or result.stdout.data).decode("utf-8", "replace").strip()
                raise SandboxUnavailable(f"the probe answered exit {result.exit_code}: {detail[:300]}")
        except (OSError, SandboxUnavailable) as exc:
            self.path = "cold"
            self.why_cold = f"the warm parent cannot run here ({exc})"
            log.warning("code sandbox: %s; every run starts its own bwrap (the cold path)", self.why_cold)
            await self.close()
            return False
        self.path = "warm"
        log.info("code sandbox: warm parent ready (a fork per run, restarted every %d runs)", self.max_runs)
        return True

    async def _spawn(self) -> Parent:
        sandbox = self.sandbox
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sizes = {
            "workspace": sandbox.containment.workspace_bytes,
            "shm": sandbox.containment.shm_bytes,
            "tmp": TMP_BYTES,
        }
        run = _Run(
            python_args=[
                harness_source("harness_supervisor.py"),
                json.dumps(sizes),
                json.dumps([harness_source(name) for name in PRECOMPILED]),
            ],
            limits=PARENT_LIMITS,
            collect=False,
            cwd="root",
            driver=harness_source("harness_zygote.py"),
            interpreter_flags=WARM_FLAGS,
            user_namespaces=True,
        )
        try:
            if sandbox.memory.per_run:
                run.group = await asyncio.to_thread(
                    sandbox.memory.new_group, sandbox.containment.memory_bytes
                )
            run.report_fd = theirs.fileno()
            process = await asyncio.create_subprocess_exec(
                *sandbox._command(run),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                cwd="/",
                env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                **sandbox._spawn_user(),
            )
        except BaseException:
            ours.close()
            await asyncio.to_thread(run.release)
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        parent = Parent(process, ours, run)
        try:
            ready = await asyncio.wait_for(_receive(ours, 9), READY_SECONDS)
            if ready[:1] != b"Y":
                raise ConnectionError("the parent answered garbage")
            parent.rss_bytes = struct.unpack(">Q", ready[1:9])[0]
        except BaseException as exc:  # cancelled too: a parent nobody holds is stopped, never left
            await asyncio.shield(parent.close())
            if not isinstance(exc, TimeoutError | ConnectionError | OSError):
                raise
            why = parent.stderr.decode("utf-8", "replace").strip()[-500:]
            raise SandboxUnavailable(f"the warm parent did not start ({why or type(exc).__name__})") from exc
        self.started += 1
        return parent

    async def _new_slot(self, parent: Parent, prefault: bool = False) -> Slot:
        """A new slot of `parent`, in its own memory cgroup, with its first run prepared."""
        sandbox = self.sandbox
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        ours.setblocking(False)
        try:
            socket.send_fds(parent.control, [b"L"], [theirs.fileno()])
        except OSError as exc:
            ours.close()
            raise SandboxUnavailable(f"the warm parent cannot take a run ({exc})") from exc
        finally:
            theirs.close()
        slot = Slot(ours, None)
        try:
            hello, pid = await asyncio.wait_for(_receive_with_pid(ours), READY_SECONDS)
            if hello != b"Y":
                raise ConnectionError("the slot answered garbage")
            if sandbox.memory.per_run:
                slot.group = await asyncio.to_thread(_group_with, sandbox, pid)
                slot.events = sandbox.memory.open_events(slot.group)
            slot.prepare(prefault=prefault)
        except BaseException as exc:  # cancelled too: its cgroup and process are given back
            await asyncio.shield(asyncio.to_thread(parent.drop, slot))
            if not isinstance(exc, TimeoutError | ConnectionError | OSError):
                raise
            raise await self._lost(parent, "the warm parent could not start a slot", exc) from exc
        parent.slots.append(slot)
        return slot

    async def _take(self) -> tuple[Parent, Slot]:
        """The parent and slot a run goes to (a new parent if there is none, it died, or it served its
        runs; a new slot if none is free)."""
        async with self._lock:
            parent = self.current
            if parent is not None and (not parent.alive or parent.runs >= self.max_runs):
                self._retire(parent)
                parent = self.current = None
            if parent is None:
                parent = self.current = await self._spawn()
            slot = None
            while parent.free and slot is None:
                # A prepared slot first, the one given back last (its pages the most recently touched); else
                # the slot given back last, prepared here.
                ready = [index for index, free in enumerate(parent.free) if free.ready is not None]
                slot = parent.free.pop(ready[-1] if ready else -1)
                if slot.ready is None:
                    try:
                        slot.prepare()  # given back moments ago: its preparation was not made yet
                    except OSError:
                        # The slot ended meanwhile (its cgroup's memory cap killed it, say): dropped, and
                        # the run takes another slot or a new one, never an error for a slot's end.
                        await asyncio.to_thread(parent.drop, slot)
                        slot = None
            if slot is None:
                slot = await self._new_slot(parent)
            parent.runs += 1
            parent.inflight += 1
            self.runs += 1
            return parent, slot

    def _background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background_work.add(task)
        task.add_done_callback(self._background_work.discard)

    def _retire(self, parent: Parent) -> None:
        parent.retiring = True
        if parent.inflight == 0:
            self._background(parent.close())

    def _give_back(self, parent: Parent, slot: Slot, healthy: bool) -> None:
        parent.inflight -= 1
        if not (healthy and parent.alive and not parent.retiring):
            self._background(asyncio.to_thread(parent.drop, slot))
        elif parent.inflight == 0:
            # An idle worker: the next run is prepared a moment later, with the page copy.
            parent.free.append(slot)
            if parent.deferred is None:
                parent.deferred = asyncio.get_running_loop().call_later(
                    PREPARE_AFTER_SECONDS, self._prepare_free, parent
                )
            if len(parent.slots) <= self.spare_slots and not parent.adding:
                parent.adding = True
                self._background(self._add_spare(parent))
        elif self._prepare(parent, slot, prefault=False):
            # Under concurrent runs (a grading batch) the next run is prepared now, without the copy: it
            # would take CPU from the runs in flight, for pages most runs never write.
            parent.free.append(slot)
        if parent.retiring and parent.inflight == 0:
            self._retire(parent)

    async def _add_spare(self, parent: Parent) -> None:
        """A slot more for an idle worker, its first run prepared (in the background: nothing waits)."""
        await asyncio.sleep(PREPARE_AFTER_SECONDS)  # after the answer of the run just made
        try:
            if not parent.alive or parent.retiring:
                return
            slot = await self._new_slot(parent, prefault=parent.inflight == 0)
        except SandboxUnavailable as exc:
            if parent.alive and not parent.retiring:
                log.warning("code sandbox: no spare slot: %s", exc)
            return
        finally:
            parent.adding = False
        if parent.alive and not parent.retiring:
            parent.free.append(slot)
        else:
            await asyncio.to_thread(parent.drop, slot)

    def _prepare(self, parent: Parent, slot: Slot, prefault: bool) -> bool:
        """Ask the slot to prepare its next run; False, and the slot dropped, when it cannot be asked."""
        try:
            slot.prepare(prefault=prefault)
        except OSError:
            self._background(asyncio.to_thread(parent.drop, slot))
            return False
        return True

    def _prepare_free(self, parent: Parent) -> None:
        """Prepare the free slots given back to an idle worker that no run has taken since."""
        parent.deferred = None
        if not parent.alive or parent.retiring:
            return
        for slot in list(parent.free):
            if slot.ready is None and not self._prepare(parent, slot, prefault=parent.inflight == 0):
                parent.free.remove(slot)  # no run takes it before it is dropped

    async def close(self) -> None:
        parent, self.current = self.current, None
        if parent is not None:
            await parent.close()
        if self._background_work:
            await asyncio.gather(*self._background_work, return_exceptions=True)

    async def run(
        self,
        files: Mapping[str, bytes],
        program: Program,
        limits: Limits,
        *,
        stdin: bytes = b"",
        collect: bool = False,
        cwd: Literal["workspace", "root"] = "workspace",
    ) -> RunResult:
        """Run `program` on `files` in a fork of the parent. SandboxUnavailable when the parent could not
        take it or died during it (the caller answers 503); never for what the run itself did."""
        parent, slot = await self._take()
        healthy = False
        try:
            result = await self._run(parent, slot, files, program, limits, stdin, collect, cwd)
            healthy = True
            return result
        finally:
            self._give_back(parent, slot, healthy)

    async def _run(
        self,
        parent: Parent,
        slot: Slot,
        files: Mapping[str, bytes],
        program: Program,
        limits: Limits,
        stdin: bytes,
        collect: bool,
        cwd: str,
    ) -> RunResult:
        sandbox = self.sandbox
        loop = asyncio.get_running_loop()
        sock, slot.ready = slot.ready, None
        assert sock is not None
        pipes = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr
        pidfd = -1
        transports: list[asyncio.BaseTransport] = []
        tasks: list[asyncio.Future[Any]] = []  # ended before the run's socket and pipes are closed
        ooms = slot.oom_kills(sandbox.memory)
        try:
            started = time.perf_counter()
            try:
                socket.send_fds(sock, [b"J"], [pipes[0][0], pipes[1][1], pipes[2][1]])
                for index, end in ((0, 0), (1, 1), (2, 1)):
                    os.close(pipes[index][end])
                pipes = [(-1, pipes[0][1]), (pipes[1][0], -1), (pipes[2][0], -1)]
                async with asyncio.timeout(READY_SECONDS):  # the job's sending too: nothing waits unbounded
                    await loop.sock_sendall(sock, _job(sandbox, files, program, limits, collect, cwd))
                    hello, pid = await _receive_with_pid(sock)
                if hello != b"P":
                    raise ConnectionError("the run's sandbox answered garbage")
            except (TimeoutError, ConnectionError, OSError) as exc:
                raise await self._lost(parent, "the run's sandbox did not start", exc) from exc
            with contextlib.suppress(ProcessLookupError):
                pidfd = os.pidfd_open(pid)  # its init: killing it ends every process of the run

            # Each descriptor is handed over once: what takes it closes it, whatever happens to this call.
            stdin_fd, pipes[0] = pipes[0][1], (-1, -1)
            taken: list[bool] = []
            stdin_writer = asyncio.ensure_future(_write_pipe(stdin_fd, stdin, transports, taken))
            stdin_writer.add_done_callback(functools.partial(_close_untaken, stdin_fd, taken))
            tasks.append(stdin_writer)
            overflow = asyncio.Event()
            readers = []
            for index in (1, 2):
                read_fd, pipes[index] = pipes[index][0], (-1, -1)
                reader, transport = await _read_pipe(read_fd)
                transports.append(transport)
                readers.append(asyncio.ensure_future(_read_capped(reader, limits.output_bytes, overflow)))
                tasks.append(readers[-1])
            raw = bytearray()
            report_task = asyncio.ensure_future(_receive_all(sock, report_cap(limits), raw))
            stopper = asyncio.ensure_future(overflow.wait())
            tasks += [report_task, stopper]
            done, _ = await asyncio.wait(
                {report_task, stopper},
                timeout=limits.wall_seconds + SETUP_GRACE_SECONDS,
                return_when="FIRST_COMPLETED",
            )
            deadline_hit = report_task not in done and not overflow.is_set()
            if report_task not in done and pidfd >= 0:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            stopper.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(report_task, REPORT_GRACE_SECONDS)
            stdout, stderr = await asyncio.gather(*readers)
            stdin_writer.cancel()
            wall = time.perf_counter() - started
            report = parse_report(bytes(raw))
            memory_exceeded = slot.oom_kills(sandbox.memory) > ooms
            if report.exit_code is None and not (deadline_hit or overflow.is_set()):
                if await parent.died(PARENT_GONE_SECONDS):
                    raise SandboxUnavailable("the warm sandbox's parent stopped during the run; retry it")
                if not (report.timed_out or memory_exceeded):
                    # The run's init is harness code its program cannot signal: ended without its report
                    # (killed from outside, or failed), it is the sandbox's failure, not the program's.
                    raise SandboxUnavailable("the warm sandbox's run ended before its report; retry it")
            return RunResult.reported(
                report,
                stdout=stdout,
                stderr=stderr,
                wall_seconds=wall,
                deadline_hit=deadline_hit,
                overflowed=overflow.is_set(),
                memory_exceeded=memory_exceeded,
                collect=collect,
            )
        finally:
            if pidfd >= 0:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                os.close(pidfd)
            # Every task reading the socket or a pipe ends before they are closed (a call cancelled mid-run
            # leaves none waiting on a descriptor whose number the next socket or pipe may get).
            pending = [task for task in tasks if not task.done()]
            for task in pending:
                task.cancel()
            try:
                if pending:
                    await asyncio.shield(asyncio.gather(*pending, return_exceptions=True))
            finally:
                sock.close()
                for transport in transports:
                    transport.close()
                for pair in pipes:
                    for fd in pair:
                        if fd >= 0:
                            with contextlib.suppress(OSError):
                                os.close(fd)

    async def _lost(self, parent: Parent, what: str, exc: BaseException) -> SandboxUnavailable:
        if await parent.died(PARENT_GONE_SECONDS):
            return SandboxUnavailable(f"{what}: the warm sandbox's parent stopped; retry it")
        await asyncio.sleep(0)  # what the parent's processes wrote before they ended
        said = parent.said()
        return SandboxUnavailable(f"{what} ({type(exc).__name__}: {exc}{'; ' + said if said else ''})")


def _group_with(sandbox: Sandbox, pid: int) -> Path:
    """A memory cgroup of its own for the slot `pid` (which its runs are then born in)."""
    group = sandbox.memory.new_group(sandbox.containment.memory_bytes)
    assert group is not None
    try:
        (group / "cgroup.procs").write_text(str(pid))
    except OSError:
        release_group(group)
        raise
    return group


def _job(
    sandbox: Sandbox,
    files: Mapping[str, bytes],
    program: Program,
    limits: Limits,
    collect: bool,
    cwd: str,
) -> bytes:
    """The request a run's keeper reads: u32 length, JSON header, then the files' bytes."""
    rlimits = {
        "RLIMIT_CPU": limits.cpu_seconds,
        "RLIMIT_NOFILE": limits.open_files,
        "RLIMIT_FSIZE": limits.file_bytes,
        "RLIMIT_CORE": 0,
        "RLIMIT_NPROC": limits.processes,
    }
    if not sandbox.memory.per_run:
        rlimits["RLIMIT_AS"] = sandbox.containment.memory_bytes
    argv = [WORKSPACE_MOUNT if arg == WORKSPACE_ARG else arg for arg in program.argv]
    blob = b"".join(files.values())
    header = {
        "files": [[path, len(content)] for path, content in files.items()],
        "blob": len(blob),
        "sizes": {
            "workspace": sandbox.containment.workspace_bytes,
            "tmp": limits.tmp_bytes,
            "shm": sandbox.containment.shm_bytes,
        },
        "wall": limits.wall_seconds,
        "collect": collect,
        "max_files": limits.max_files,
        "max_bytes": limits.max_workspace_bytes,
        "limits": rlimits,
        "cwd": cwd,
        "isolated": program.isolated,
        "code": program.code,
        "argv": argv,
    }
    body = json.dumps(header).encode("utf-8")
    return struct.pack(">I", len(body)) + body + blob


async def _readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await waiter
    finally:
        loop.remove_reader(sock.fileno())


async def _receive(sock: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = bytearray()
    while len(data) < size:
        chunk = await loop.sock_recv(sock, size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


async def _receive_with_pid(sock: socket.socket) -> tuple[bytes, int]:
    """One byte from the sandbox, and the pid of the process that sent it as this process sees it (the
    kernel's credentials: a process in another pid namespace cannot forge them)."""
    while True:
        try:
            data, ancillary, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(struct.calcsize("iII")))
            break
        except BlockingIOError:
            await _readable(sock)
    if not data:
        raise ConnectionError("the sandbox's socket closed")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid, _, _ = struct.unpack("iII", payload[: struct.calcsize("iII")])
            if pid > 0:
                return data, pid
    raise ConnectionError("the sandbox sent no credentials")


async def _receive_all(sock: socket.socket, cap: int, into: bytearray) -> None:
    loop = asyncio.get_running_loop()
    while len(into) <= cap:
        try:
            chunk = await loop.sock_recv(sock, 65536)
        except (ConnectionError, OSError):
            return
        if not chunk:
            return
        into += chunk


async def _read_pipe(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    """A reader of `fd`, which it owns from here (closed here if the transport is never made)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=HARD_OUTPUT_BYTES)
    pipe = os.fdopen(fd, "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    except BaseException:
        pipe.close()  # a no-op when the cancelled transport closed it already
        raise
    return reader, transport


def _close_untaken(fd: int, taken: list[bool], task: asyncio.Future[None]) -> None:
    """The stdin writer's descriptor, when the writer was cancelled before it ran (it owns it otherwise)."""
    if not taken:
        with contextlib.suppress(OSError):
            os.close(fd)


async def _write_pipe(
    fd: int, data: bytes, transports: list[asyncio.BaseTransport], taken: list[bool]
) -> None:
    """Write `data` to `fd` and close it; `taken` says it now owns `fd`."""
    taken.append(True)
    loop = asyncio.get_running_loop()
    if not data:
        os.close(fd)
        return
    pipe = os.fdopen(fd, "wb", buffering=0)
    try:
        transport, protocol = await loop.connect_write_pipe(lambda: asyncio.streams.FlowControlMixin(), pipe)
    except BaseException:
        pipe.close()
        raise
    transports.append(transport)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    try:
        writer.write(data)
        await writer.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        transport.close()
