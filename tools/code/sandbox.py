"""Running untrusted Python: a small interface and its one real implementation, bubblewrap.

Every run gets a fresh, size-capped tmpfs at `/workspace` holding the workspace's files (copied in from
memory), in a new user, pid, network, ipc, uts and mount namespace (no network device but loopback, so
no network at all), with the system directories read-only, a private size-capped `/tmp` and
`/dev/shm`, an unprivileged uid, a cgroup capping the memory of all its processes together (where the
host offers one; see `memory.py`), rlimits (CPU seconds, processes, open files, file size) and a
wall-clock timeout that kills the whole process tree. A supervisor inside (`harness_supervisor.py`)
starts the program and sends back its exit status and the files it left. Nothing a run does reaches the
server's process or disk: the server reads the run's output and that report, and checks both itself.

`unsafe-local` runs the same commands without isolation, for local development on machines without
user namespaces; the server refuses it on a non-loopback address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import stat
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tools.code.freezer import Freezer
from tools.code.freezer import detect as detect_freezer
from tools.code.memory import MemoryCap, owner_alive, process_identity, stat_fields
from tools.code.memory import detect as detect_memory_cap
from tools.code.memory import release as release_group

if TYPE_CHECKING:
    from tools.code.warm import WarmRunner

log = logging.getLogger("sparring.packs.code.sandbox")

SandboxMode = Literal["bwrap", "unsafe-local"]
MODES: tuple[SandboxMode, ...] = ("bwrap", "unsafe-local")

WORKSPACE_MOUNT = "/workspace"
# An argument equal to this is replaced by the workspace's path as the run sees it.
WORKSPACE_ARG = "{workspace}"
# When the server runs as root, bwrap itself is started as this unprivileged uid, so the sandbox's
# processes hold no privilege on the host either and the process limit applies to them.
UNPRIVILEGED_ID = 65534
# The most output read from one stream before the run is stopped: past the cap, output is only counted.
HARD_OUTPUT_BYTES = 4 * 1024 * 1024
# The sandbox itself (bwrap's setup, the supervisor's start and its report) gets this beyond the run's
# own wall-clock limit, which the supervisor enforces.
SETUP_GRACE_SECONDS = 15.0
# How long the report may take to arrive once the sandbox's process has ended.
REPORT_GRACE_SECONDS = 5.0
FREEZE_PASSES = 64  # over a session's processes when stopping them (each pass stops what forked meanwhile)
# The stop is checked this much later, up to FREEZE_CHECKS times, and a process seen running is stopped
# again; one still running at the last check (another process of the session keeps continuing it with
# SIGCONT) is killed, unless it is the interpreter's own driver.
FREEZE_CHECK_SECONDS = 0.002
FREEZE_CHECKS = 32
# A worker's directory is named after it (pid and start time), so a later worker removes those of gone
# ones; a directory named the old way (without its worker) is removed once it has not changed for this.
ROOT_PREFIX = "sparring-code-"
_ROOT_NAME = re.compile(r"sparring-code-(?:(\d+-\d+)-)?[A-Za-z0-9_]{8}")
UNNAMED_ROOT_AGE_SECONDS = 3600.0
_SETPRIV_ARGS = (f"--reuid={UNPRIVILEGED_ID}", f"--regid={UNPRIVILEGED_ID}", "--clear-groups")
SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib32", "/lib64", "/sbin")

INSTALL_HELP = (
    "install Debian's bubblewrap (`apt-get install bubblewrap`). In a container, bwrap needs to create "
    "user namespaces: with Docker or Compose run the service with `security_opt: [seccomp=unconfined, "
    "apparmor=unconfined]` (or a seccomp profile that allows unshare/clone with CLONE_NEWUSER); on "
    "Kubernetes use a Pod with `securityContext.seccompProfile.type: Unconfined` and the AppArmor "
    "profile `unconfined`, on nodes whose kernel allows unprivileged user namespaces "
    "(`sysctl kernel.unprivileged_userns_clone=1`, `user.max_user_namespaces` > 0). For local "
    "development only, SPARRING_CODE_SANDBOX=unsafe-local runs code without isolation"
)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run code here (bwrap missing or unable to create namespaces), or a run's sandbox
    did not start: an outage, never something the run itself did."""


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    processes: int = 32
    open_files: int = 64
    file_bytes: int = 1024 * 1024  # largest file a run may write
    tmp_bytes: int = 16 * 1024 * 1024  # size of the private /tmp
    output_bytes: int = 16 * 1024  # kept per stream (stdout, stderr)
    # What is read back from the workspace after a run.
    max_files: int = 50
    max_workspace_bytes: int = 2 * 1024 * 1024


@dataclass(frozen=True)
class Output:
    data: bytes  # the first `output_bytes` bytes
    total: int  # bytes the stream carried (up to the hard cap)

    @property
    def cut(self) -> int:
        return self.total - len(self.data)


@dataclass(frozen=True)
class RunResult:
    exit_code: int | None  # None when the run was killed (timeout, output overflow) or stopped its supervisor
    stdout: Output
    stderr: Output
    wall_seconds: float
    timed_out: bool = False
    output_overflow: bool = False
    memory_exceeded: bool = False  # the kernel killed a process of the run for going over its memory cap
    files: dict[str, bytes] | None = None  # the workspace after the run, when collected
    skipped: list[str] = field(default_factory=list)  # files left behind but not kept, with the reason
    # The paths of those the walk did not look at or into (a directory it could not list: nothing under it
    # was seen), and of the rollout's files no run could hold (`place_files`): none of them is deleted.
    unseen: frozenset[str] = frozenset()
    # False when the walk stopped at a limit: a file missing from `files` may still be there.
    files_complete: bool = True

    @classmethod
    def reported(
        cls,
        report: Report,
        *,
        stdout: Output,
        stderr: Output,
        wall_seconds: float,
        deadline_hit: bool,
        overflowed: bool,
        memory_exceeded: bool,
        collect: bool,
    ) -> RunResult:
        """A run's result from its supervisor's report and what the server saw of it (its deadline,
        its output, the memory cap): no exit code for a run that was killed."""
        timed_out = report.timed_out or deadline_hit
        return cls(
            exit_code=None if timed_out or overflowed else report.exit_code,
            stdout=stdout,
            stderr=stderr,
            wall_seconds=wall_seconds,
            timed_out=timed_out,
            output_overflow=overflowed,
            memory_exceeded=memory_exceeded,
            files=report.files if collect else None,
            skipped=report.skipped,
            unseen=report.unseen,
            files_complete=not report.truncated,
        )


def _reachable_by_others(path: Path) -> bool:
    """True if a process of another uid can execute `path` (every directory above it searchable)."""
    try:
        resolved = path.resolve(strict=True)
        if not resolved.stat().st_mode & stat.S_IXOTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in resolved.parents)
    except OSError:
        return False


def find_python(configured: Path | None, *, for_other_uid: bool) -> Path:
    """The interpreter sandboxed code runs with: `configured`, else the server's own, else the system's."""
    if configured is not None:
        if not configured.is_file():
            raise SandboxUnavailable(f"SPARRING_CODE_PYTHON={configured} is not a file")
        return configured
    base = Path(getattr(sys, "_base_executable", sys.executable))
    for candidate in (base, Path("/usr/bin/python3"), Path("/usr/local/bin/python3")):
        if candidate.is_file() and (not for_other_uid or _reachable_by_others(candidate)):
            return candidate.resolve()
    raise SandboxUnavailable(
        "no Python interpreter the sandbox user can run was found (the server's own lies in a directory "
        "other users cannot enter); install python3 or set SPARRING_CODE_PYTHON"
    )


@dataclass(frozen=True)
class Containment:
    """What one worker allows all runs (from the settings), beside each run's own `Limits`."""

    memory_bytes: int = 1024 * 1024 * 1024  # all processes of one run together (per process without cgroups)
    workspace_bytes: int = 64 * 1024 * 1024  # size of the run's /workspace, a tmpfs
    shm_bytes: int = 16 * 1024 * 1024  # size of /dev/shm
    slots: int = 0  # runs at once in one worker; 0: twice the CPU count, at least 2
    slots_per_rollout: int = 2  # runs of one rollout at once, so a busy rollout cannot starve the others


class _Slots:
    """The worker's run slots, and for each rollout a bound on how many of them it holds."""

    def __init__(self, total: int, per_owner: int) -> None:
        self.total = asyncio.Semaphore(total)
        self.per_owner = per_owner
        self.owners: dict[str, tuple[asyncio.Semaphore, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, owner: str | None) -> AsyncIterator[None]:
        if owner is None:
            async with self.total:
                yield
            return
        mine, users = self.owners.get(owner, (asyncio.Semaphore(self.per_owner), 0))
        self.owners[owner] = (mine, users + 1)
        try:
            # The rollout's own bound first: its waiting runs do not queue for the worker's slots.
            async with mine, self.total:
                yield
        finally:
            mine, users = self.owners[owner]
            if users <= 1:
                del self.owners[owner]
            else:
                self.owners[owner] = (mine, users - 1)


# bwrap's namespaces, user and environment for every run: no network, an unprivileged uid, a clean env.
_BWRAP_IDENTITY = (
    "--unshare-all",  # pid, net, ipc, uts, cgroup namespaces: no network at all
    "--unshare-user",
    "--disable-userns",
    "--die-with-parent",
    "--new-session",
    "--hostname",
    "sandbox",
    "--uid",
    str(UNPRIVILEGED_ID),
    "--gid",
    str(UNPRIVILEGED_ID),
    "--clearenv",
    "--setenv",
    "PATH",
    "/usr/local/bin:/usr/bin:/bin",
    "--setenv",
    "HOME",
    "/tmp",
    "--setenv",
    "TMPDIR",
    "/tmp",
    "--setenv",
    "LANG",
    "C.UTF-8",
)


class Sandbox:
    """Runs the configured Python on a copy of some files, isolated by bwrap unless `isolated` is False."""

    def __init__(
        self,
        *,
        isolated: bool,
        python: Path,
        bwrap: str | None,
        prlimit: str | None,
        root: Path,
        containment: Containment,
        memory_cap: MemoryCap,
        freezer: Freezer | None = None,
    ) -> None:
        self.isolated = isolated
        self.python = python
        self.bwrap = bwrap
        self.prlimit = prlimit
        self.root = root
        self.containment = containment
        self.memory = memory_cap
        self.freezer = freezer or Freezer("signals")  # how a session is stopped between its requests
        self.shell = shutil.which("sh") or "/bin/sh"
        self.switch_user = isolated and os.geteuid() == 0
        self.setpriv = shutil.which("setpriv") if self.switch_user else None
        self.max_parallel = containment.slots or max(2, 2 * (os.cpu_count() or 1))
        # One set of slots for the sandbox's life: its owner (the code pack's lifespan) runs on one loop.
        self._slots = _Slots(self.max_parallel, max(1, containment.slots_per_rollout))
        self._mounts = self._system_mounts() if isolated else []
        # The warm parent (tools/code/warm.py), set by the code pack's lifespan when it works here.
        self.warm: WarmRunner | None = None

    def close(self) -> None:
        """Remove the directory the workspaces of runs are made in (runs still going keep theirs).

        Its owner calls it once it is done with the sandbox (the code pack, when the app stops)."""
        with contextlib.suppress(OSError):
            self.root.rmdir()

    @property
    def mode(self) -> SandboxMode:
        return "bwrap" if self.isolated else "unsafe-local"

    def _system_mounts(self) -> list[str]:
        args: list[str] = []
        for directory in SYSTEM_DIRS:
            path = Path(directory)
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), directory]
            elif path.is_dir():
                args += ["--ro-bind", directory, directory]
        prefix = self.python.parent.parent
        if not any(prefix == Path(d) or Path(d) in prefix.parents for d in SYSTEM_DIRS) and prefix != Path(
            "/"
        ):
            args += ["--ro-bind", str(prefix), str(prefix)]
        if Path("/etc/ld.so.cache").is_file():  # where the loader finds shared libraries (libssl, libffi)
            args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        return args

    def _command(self, run: _Run) -> list[str]:
        """The run's whole command line: the supervisor (or a session's driver), under prlimit, bwrap,
        setpriv and its cgroup."""
        command = self._driver(run) if run.driver is not None else self._supervisor(run)
        if self.prlimit is not None:
            command = self._under_prlimit(run, command)
        if self.isolated:
            command = self._under_bwrap(run, command)
        if self.switch_user and self.setpriv is not None:
            # setpriv drops to the unprivileged uid in the child, so the server forks cheaply (vfork)
            command = [self.setpriv, *_SETPRIV_ARGS, "--", *command]
        groups = [group for group in (run.group, run.freezer_group) if group is not None]
        if groups:
            # Joins the run's cgroups before anything else starts, so every process of the run is in them.
            joins = " && ".join(f'echo $$ > "${index}"' for index in range(len(groups)))
            procs = [str(group / "cgroup.procs") for group in groups]
            shift = " && shift" if len(groups) == 2 else ""
            command = [self.shell, "-c", f'{joins}{shift} && exec "$@"', *procs, *command]
        return command

    def _supervisor(self, run: _Run) -> list[str]:
        """The supervisor (a Python of its own) that runs `python_args` and reports on `report_fd`."""
        limits = run.limits
        inside = WORKSPACE_MOUNT if self.isolated else str(run.workspace)
        args = [inside if arg == WORKSPACE_ARG else arg for arg in run.python_args]
        return [
            str(self.python),
            *("-I", "-S", "-B", "-c", _supervisor_source()),
            str(run.report_fd),
            str(limits.wall_seconds),
            "1" if run.collect else "0",
            str(limits.max_files),
            str(limits.max_workspace_bytes),
            "1" if self.isolated else "0",
            inside,
            "--",
            *args,
        ]

    def _driver(self, run: _Run) -> list[str]:
        """A session's driver: `python -I -S -B -c <source> FRAME_FD WORKSPACE ARGS...`."""
        assert run.driver is not None
        inside = WORKSPACE_MOUNT if self.isolated else str(run.workspace)
        return [
            str(self.python),
            *run.interpreter_flags,
            "-c",
            run.driver,
            str(run.report_fd),
            inside,
            *run.python_args,
        ]

    def _under_prlimit(self, run: _Run, command: list[str]) -> list[str]:
        assert self.prlimit is not None
        limits = run.limits
        return [
            self.prlimit,
            f"--cpu={limits.cpu_seconds}",
            # With a cgroup the run's memory is capped as a whole; else each process is.
            *([] if run.group is not None else [f"--as={self.containment.memory_bytes}"]),
            f"--nofile={limits.open_files}",
            f"--fsize={limits.file_bytes}",
            "--core=0",
            # The process limit counts every process of the uid: per sandbox only under bwrap.
            *([f"--nproc={limits.processes}"] if self.isolated else []),
            "--",
            *command,
        ]

    def _under_bwrap(self, run: _Run, command: list[str]) -> list[str]:
        assert self.bwrap is not None
        identity = [arg for arg in _BWRAP_IDENTITY if arg != "--disable-userns" or not run.user_namespaces]
        return [
            self.bwrap,
            *identity,
            *self._mounts,
            *self._scratch_mounts(run),
            *run.file_args,
            "--remount-ro",
            "/",
            "--chdir",
            WORKSPACE_MOUNT if run.cwd == "workspace" else "/",
            "--",
            *command,
        ]

    def _scratch_mounts(self, run: _Run) -> list[str]:
        """/proc, /dev and the size-capped tmpfs mounts of a run: /dev/shm, /tmp and the workspace."""
        return [
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            # /dev is a tmpfs without a size: read-only, with a small /dev/shm of its own.
            "--size",
            str(self.containment.shm_bytes),
            "--tmpfs",
            "/dev/shm",
            "--remount-ro",
            "/dev",
            "--size",
            str(run.limits.tmp_bytes),
            "--tmpfs",
            "/tmp",
            # The workspace lives in the sandbox's memory, size-capped, and vanishes with it: what a
            # run writes never reaches the host's disk, and nothing is left to clean up.
            "--size",
            str(self.containment.workspace_bytes),
            "--tmpfs",
            WORKSPACE_MOUNT,
        ]

    async def run(
        self,
        files: Mapping[str, str | bytes],
        python_args: Sequence[str],
        *,
        limits: Limits,
        stdin: bytes = b"",
        collect: bool = False,
        cwd: Literal["workspace", "root"] = "workspace",
        owner: str | None = None,
    ) -> RunResult:
        """Run `python <python_args>` on a fresh copy of `files`; with `collect`, read the files back.

        `owner` (the rollout) bounds how many runs of it hold a slot at once. OSError or
        SandboxUnavailable when the sandbox itself could not run: an outage, never the run's doing.
        """
        placed, conflicts = place_files(files)
        program = self.warm.program(python_args, limits) if self.warm is not None else None
        async with self._slots.hold(owner):
            if program is not None and self.warm is not None:
                result = await self.warm.run(placed, program, limits, stdin=stdin, collect=collect, cwd=cwd)
                return _with_conflicts(result, conflicts) if collect else result
            run = _Run(python_args=python_args, limits=limits, collect=collect, cwd=cwd)
            try:
                if self.memory.per_run:
                    run.group = await asyncio.to_thread(self.memory.new_group, self.containment.memory_bytes)
                if self.isolated:
                    run.file_args, run.input_fds = await asyncio.to_thread(_input_files, placed)
                else:
                    run.workspace = await asyncio.to_thread(self._materialize, placed)
                result = await self._run(run, stdin)
            finally:
                await asyncio.to_thread(run.release)
        return _with_conflicts(result, conflicts) if collect else result

    def hold_slot(self, owner: str | None) -> contextlib.AbstractAsyncContextManager[None]:
        """One of the worker's run slots (and of the rollout's share), for work that is not `run`."""
        return self._slots.hold(owner)

    async def open_session(self, driver: str, args: Sequence[str], *, limits: Limits) -> Session:
        """Start a long-lived sandboxed Python running `driver` (its source), with an empty workspace.

        The driver reads requests on its stdin and answers on the frame pipe; the session lives until
        `close()`: the same containment as a run, but no wall-clock limit of its own (its owner keeps
        the time). OSError or SandboxUnavailable when it could not start.
        """
        run = _Run(python_args=args, limits=limits, collect=False, cwd="workspace", driver=driver)
        try:
            if self.memory.per_run:
                run.group = await asyncio.to_thread(self.memory.new_group, self.containment.memory_bytes)
            if self.freezer.mechanism == "own-cgroup":
                run.freezer_group = await asyncio.to_thread(self.freezer.new_group)
            if not self.isolated:
                run.workspace = await asyncio.to_thread(self._materialize, {})
            process, frames, _ = await self._spawn(run)
        except BaseException:
            await asyncio.to_thread(run.release)
            raise
        return Session(self, run, process, frames)

    def _materialize(self, files: Mapping[str, bytes]) -> Path:
        """The run's files in a directory of the host (only without isolation)."""
        workspace = Path(tempfile.mkdtemp(prefix="ws-", dir=self.root))
        for relative, content in files.items():
            path = workspace / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
        return workspace

    async def _run(self, run: _Run, stdin: bytes) -> RunResult:
        limits = run.limits
        process, report_r, started = await self._spawn(run)
        raw = bytearray()
        report_task = asyncio.ensure_future(_read_report(report_r, report_cap(limits), raw))
        overflow = asyncio.Event()
        assert process.stdout is not None and process.stderr is not None and process.stdin is not None
        readers = [
            asyncio.ensure_future(_read_capped(process.stdout, limits.output_bytes, overflow)),
            asyncio.ensure_future(_read_capped(process.stderr, limits.output_bytes, overflow)),
        ]
        writer = asyncio.ensure_future(_feed(process.stdin, stdin))
        deadline_hit = await _supervise(process, limits, overflow, writer, report_task)
        stdout, stderr = await asyncio.gather(*readers)
        wall = time.perf_counter() - started
        report = parse_report(bytes(raw))
        if not report.started:
            detail = stderr.data.decode("utf-8", "replace").strip()[:500]
            raise SandboxUnavailable(
                f"the {self.mode} sandbox did not start (exit {process.returncode}: {detail or 'no output'})"
            )
        return RunResult.reported(
            report,
            stdout=stdout,
            stderr=stderr,
            wall_seconds=wall,
            deadline_hit=deadline_hit,
            overflowed=overflow.is_set(),
            memory_exceeded=run.group is not None and self.memory.out_of_memory(run.group),
            collect=run.collect,
        )

    def _spawn_user(self) -> dict[str, Any]:
        """How the sandbox's process is started as the unprivileged uid when setpriv is missing."""
        if self.switch_user and self.setpriv is None:
            return {"user": UNPRIVILEGED_ID, "group": UNPRIVILEGED_ID, "extra_groups": []}
        return {}

    async def _spawn(self, run: _Run) -> tuple[asyncio.subprocess.Process, int, float]:
        """Start the run's process; returns it, the read end of its report pipe and when it started."""
        report_r, report_w = os.pipe()
        run.report_fd = report_w
        try:
            command = self._command(run)
            env = {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": str(run.workspace or "/"),
                "LANG": "C.UTF-8",
            }
            user = self._spawn_user()
            started = time.perf_counter()
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=str(run.workspace or "/"),
                env=env,
                pass_fds=(report_w, *run.input_fds),
                start_new_session=True,  # its own process group: one kill reaches the whole tree
                **user,
            )
        except BaseException:
            os.close(report_r)
            raise
        finally:
            os.close(report_w)
            run.close_inputs()  # bwrap has its copies
        return process, report_r, started


async def _supervise(
    process: asyncio.subprocess.Process,
    limits: Limits,
    overflow: asyncio.Event,
    writer: asyncio.Future[None],
    report_task: asyncio.Future[None],
) -> bool:
    """Wait for the run to end, or kill its group at the sandbox's deadline or on an output overflow;
    whatever happens, leave nothing of it running. True when the sandbox's own deadline struck."""
    waiter = asyncio.ensure_future(process.wait())
    stopper = asyncio.ensure_future(overflow.wait())
    deadline_hit = False
    try:
        # The supervisor stops the run at its wall-clock limit; this deadline is for the sandbox itself.
        done, _ = await asyncio.wait(
            {waiter, stopper},
            timeout=limits.wall_seconds + SETUP_GRACE_SECONDS,
            return_when="FIRST_COMPLETED",
        )
        if waiter not in done:
            deadline_hit = not overflow.is_set()
            _kill_group(process.pid)
        await waiter
    finally:
        _kill_group(process.pid)  # whatever the run left in its group (the pid namespace is gone already)
        if not waiter.done():
            kill_process(process)
            await waiter
        stopper.cancel()
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await writer
        # What came is kept even if the pipe is still held open: a report cut short keeps no files,
        # but one that began shows the sandbox started.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(report_task, REPORT_GRACE_SECONDS)
    return deadline_hit


@dataclass
class _Run:
    """One run's parts: what it runs and what it holds on the host until it is released."""

    python_args: Sequence[str]
    limits: Limits
    collect: bool
    cwd: str
    group: Path | None = None  # its cgroup
    freezer_group: Path | None = None  # a session's own v2 cgroup for the freezer (`Freezer.new_group`)
    workspace: Path | None = None  # its directory on the host (only without isolation)
    file_args: list[str] = field(default_factory=list)  # bwrap's arguments placing the files
    input_fds: list[int] = field(default_factory=list)  # the files' contents, for bwrap to copy
    report_fd: int = -1
    driver: str | None = None  # a session's driver source (the supervisor when None)
    interpreter_flags: tuple[str, ...] = ("-I", "-S", "-B")  # the driver's
    user_namespaces: bool = False  # may create user namespaces (the warm parent: each run makes its own)

    def close_inputs(self) -> None:
        for fd in self.input_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.input_fds = []

    def release(self) -> None:
        """Give back what the run held on the host; never raises."""
        self.close_inputs()
        if self.group is not None:
            release_group(self.group)
        if self.freezer_group is not None:
            release_group(self.freezer_group)
        if self.workspace is not None:
            remove_tree(self.workspace)


class Session:
    """A sandboxed Python that outlives one request (`Sandbox.open_session`): its process, the pipe its
    driver answers on, and what it holds on the host until `close()`."""

    def __init__(
        self, sandbox: Sandbox, run: _Run, process: asyncio.subprocess.Process, frames_fd: int
    ) -> None:
        self.sandbox = sandbox
        self.run = run
        self.process = process
        self._frames_fd = frames_fd
        self.closed = False
        self._closing: asyncio.Future[int | None] | None = None
        self._freezing: asyncio.TimerHandle | None = None
        # The processes stopped between requests (`freeze`), by pid: a pidfd each, so the one continued is
        # that process, whatever became of its pid.
        self.frozen: dict[int, int] = {}
        self._seen_stopped: set[int] = set()  # processes a check of the stop saw stopped
        self._sandbox_processes: set[int] | None = None  # bwrap's own two: they run no code of the cells
        # The session's `cgroup.freeze`, kept open (a write freezes or thaws all its processes at once);
        # -1: stopped by signals.
        self._freeze_fd = -1
        self._frozen = False  # its cgroup is frozen
        freeze_file = sandbox.freezer.freeze_file(run.group, run.freezer_group)
        if freeze_file is not None:
            with contextlib.suppress(OSError):
                self._freeze_fd = os.open(freeze_file, os.O_WRONLY | os.O_CLOEXEC)
        self.memory_exceeded = False  # known once closed: the kernel killed a process of it at the cap
        self._reader: asyncio.StreamReader | None = None
        self._transport: asyncio.BaseTransport | None = None
        overflow = asyncio.Event()  # never stops a session: its output is only drained
        assert process.stdout is not None and process.stderr is not None
        self._drains = [
            asyncio.ensure_future(_read_capped(stream, run.limits.output_bytes, overflow))
            for stream in (process.stdout, process.stderr)
        ]

    async def send(self, data: bytes) -> None:
        """Write `data` to the driver's stdin, its processes continued first if stopped (the data is
        queued before they run: the driver, woken once, finds it); ConnectionError when it is gone."""
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(data)
        self.thaw()
        await stdin.drain()

    async def receive(self, size: int) -> bytes:
        """Exactly `size` bytes of the frame pipe; asyncio.IncompleteReadError when it ended first."""
        if self._reader is None:
            loop = asyncio.get_running_loop()
            self._reader = asyncio.StreamReader(limit=2**20)
            self._transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(self._reader),  # type: ignore[arg-type]
                os.fdopen(self._frames_fd, "rb", buffering=0),
            )
        return await self._reader.readexactly(size)

    async def stderr(self) -> bytes:
        """What the session wrote to its stderr, once it is closed (bwrap's or the driver's complaint)."""
        return (await self._drains[1]).data

    def _processes(self) -> set[int]:
        """The session's processes, as its cgroup lists them (empty without one)."""
        group = self.run.group
        if group is None:
            return set()
        try:
            return {int(pid) for pid in (group / "cgroup.procs").read_text().split()}
        except (OSError, ValueError):
            return set()

    def freeze_later(self, seconds: float) -> None:
        """Stop every process of the session `seconds` from now, unless a request comes first (`thaw`):
        what a request left running does not go on between requests. Needs a cgroup of the session (its
        freezer, or its list of processes); without one, nothing is stopped."""
        if (self._freeze_fd < 0 and self.run.group is None) or self.closed:
            return
        if self._freezing is not None:
            self._freezing.cancel()
        self._freezing = asyncio.get_running_loop().call_later(seconds, self.freeze)

    def freeze(self, checks: int = FREEZE_CHECKS) -> None:
        """SIGSTOP every process of the session, again until none is left running (one forking meanwhile
        has its child stopped in the next pass); checked a moment later while any process is not seen
        stopped (a stop takes a moment; or another process continued it), which is stopped again, and
        killed at the last check if it runs again after a check saw it stopped (never the driver: the one
        that continued it is killed)."""
        self._freezing = None
        if self.closed:
            return
        if self._freeze_fd >= 0:
            # The kernel's freezer: every process of the cgroup, and any it forks, stopped as one; nothing
            # inside continues them (see freezer.py).
            try:
                os.write(self._freeze_fd, b"1")
                self._frozen = True
            except OSError:
                log.warning("code sandbox: an interpreter's cgroup could not be frozen; it is stopped")
                self.kill()
            return
        self._stop_new()
        loose = []
        for pid in self.frozen:
            state = _state(pid)
            if state in RUNNING_STATES:
                loose.append(pid)
            elif state in STOPPED_STATES:
                self._seen_stopped.add(pid)
        if not loose:
            return
        if checks == 0:
            # Only what was seen stopped and runs again was continued by another process: one never seen
            # stopped may just not have been scheduled yet (a busy machine), and is left to stop.
            driver = self._driver()
            for pid in loose:
                if pid != driver and pid in self._seen_stopped:
                    with contextlib.suppress(OSError):
                        signal.pidfd_send_signal(self.frozen[pid], signal.SIGKILL)
        for pid in loose:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.frozen[pid], signal.SIGSTOP)
        if checks > 0:
            self._freezing = asyncio.get_running_loop().call_later(
                FREEZE_CHECK_SECONDS, self.freeze, checks - 1
            )

    def _driver(self) -> int:
        """The pid of the session's own program (bwrap's pid 1's only child when isolated)."""
        inner = [pid for pid in self._sandbox_processes or () if pid != self.process.pid]
        if not inner:
            return self.process.pid
        try:
            children = Path(f"/proc/{inner[0]}/task/{inner[0]}/children").read_text().split()
        except OSError:
            return -1
        return int(children[0]) if children else -1

    def _stop_new(self) -> None:
        """SIGSTOP the session's processes not stopped yet, pass after pass until no new one is found."""
        if self._sandbox_processes is None:
            self._sandbox_processes = _sandbox_processes(self.process.pid) if self.sandbox.isolated else set()
        for _ in range(FREEZE_PASSES):
            running = self._processes() - self.frozen.keys() - self._sandbox_processes
            if not running:
                return
            for pid in running:
                try:
                    pidfd = os.pidfd_open(pid)
                except OSError:  # it ended meanwhile
                    continue
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
                except OSError:
                    os.close(pidfd)
                    continue
                self.frozen[pid] = pidfd

    def thaw(self) -> None:
        """Every process stopped by `freeze` running again (before a request is sent): through the pidfds
        kept, without listing the cgroup again (a read that costs ~0.3 ms after an idle moment here)."""
        if self._freezing is not None:
            self._freezing.cancel()
            self._freezing = None
        if self._frozen:
            self._frozen = False
            try:
                os.write(self._freeze_fd, b"0")
            except OSError:  # its driver then never answers: the request fails as a stopped interpreter
                log.warning("code sandbox: an interpreter's cgroup could not be thawed; it is stopped")
                self.kill()
        frozen, self.frozen = self.frozen, {}
        self._seen_stopped.clear()
        for pidfd in frozen.values():
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGCONT)
            os.close(pidfd)

    def kill(self) -> None:
        """Kill the session's processes now (without waiting); `close()` still gives back the rest."""
        if not self.closed:
            _kill_group(self.process.pid)
            kill_process(self.process)

    async def close(self, grace: float = 0.0) -> int | None:
        """Kill the session and everything in it (after `grace` seconds to end by itself), give back what
        it held; answers its exit status. Done to the end even when the caller is cancelled meanwhile
        (its own task, shielded), and done once: every caller gets that one closing's status."""
        if self._closing is None:
            self.closed = True
            self._closing = asyncio.ensure_future(self._close(grace))
        return await asyncio.shield(self._closing)

    async def _close(self, grace: float) -> int | None:
        self.thaw()  # its timer cancelled, its cgroup thawed, its pidfds closed (killed as any other)
        if grace > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.process.wait()), grace)
        _kill_group(self.process.pid)
        kill_process(self.process)
        code = await self.process.wait()
        if self._transport is not None:
            self._transport.close()
        elif self._frames_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._frames_fd)
        self._frames_fd = -1
        if self._freeze_fd >= 0:
            os.close(self._freeze_fd)
            self._freeze_fd = -1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._drains), REPORT_GRACE_SECONDS)
        group = self.run.group
        if group is not None and not self.memory_exceeded:
            self.memory_exceeded = self.sandbox.memory.out_of_memory(group)
        await asyncio.to_thread(self.run.release)
        self.run.group = None
        return code


RUNNING_STATES = ("R", "S")  # running, or sleeping in a wait a signal ends: not stopped (D is left to end)
STOPPED_STATES = ("T", "t")


def _state(pid: int) -> str:
    """The state of process `pid` in /proc ("" when it is gone)."""
    fields = stat_fields(pid)
    return fields[0] if fields else ""


def _sandbox_processes(top: int) -> set[int]:
    """The session's bwrap (its top process) and bwrap's pid 1 in the sandbox (its only child): nothing a
    cell starts, so they need no stopping (each stopped process costs a signal to continue it). Empty
    when the children cannot be read: everything is then stopped."""
    try:
        children = Path(f"/proc/{top}/task/{top}/children").read_text().split()
    except OSError:
        return set()
    return {top, int(children[0])} if len(children) == 1 else set()


@cache
def harness_source(name: str) -> str:
    """The source of a script that runs inside the sandbox (`harness_*.py`), passed to it with `-c`."""
    return (Path(__file__).parent / name).read_text(encoding="utf-8")


def _supervisor_source() -> str:
    return harness_source("harness_supervisor.py")


def _with_conflicts(result: RunResult, conflicts: list[str]) -> RunResult:
    """`result` saying which of the rollout's files the run could not be given (never seen, not deleted)."""
    if not conflicts:
        return result
    said = [f"{path} (a file and a directory of the same name)" for path in conflicts]
    return replace(result, skipped=[*said, *result.skipped], unseen=result.unseen | set(conflicts))


def parents(path: str) -> list[str]:
    """The directories a workspace path is in, outermost first ("a/b/c": "a", "a/b")."""
    parts = path.split("/")
    return ["/".join(parts[:end]) for end in range(1, len(parts))]


def under(path: str, paths: AbstractSet[str]) -> bool:
    """True if `path` or a directory it is in (the workspace itself included, as "") is one of `paths`."""
    return bool(paths) and ("" in paths or path in paths or any(parent in paths for parent in parents(path)))


def place_files(files: Mapping[str, str | bytes]) -> tuple[dict[str, bytes], list[str]]:
    """The files that fit in one tree, and the paths of those that cannot (a path under another file, or a
    file where a directory is): such a pair can be stored in a rollout's state, never on a disk."""
    placed: dict[str, bytes] = {}
    conflicts: list[str] = []
    directories: set[str] = set()
    for relative in sorted(files):
        above = parents(relative)
        if relative in directories or any(parent in placed for parent in above):
            conflicts.append(relative)
            continue
        content = files[relative]
        placed[relative] = content.encode("utf-8") if isinstance(content, str) else content
        directories.update(above)
    return placed, conflicts


def _input_files(files: Mapping[str, bytes]) -> tuple[list[str], list[int]]:
    """bwrap's arguments that copy `files` into the workspace, from in-memory files (nothing on disk)."""
    args: list[str] = []
    fds: list[int] = []
    made: set[str] = set()
    try:
        for relative, content in files.items():
            parts = relative.split("/")
            for i in range(1, len(parts)):
                directory = "/".join(parts[:i])
                if directory not in made:
                    made.add(directory)
                    args += ["--dir", f"{WORKSPACE_MOUNT}/{directory}"]
            fd = os.memfd_create("workspace-file", 0)
            fds.append(fd)
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view) :]
            os.lseek(fd, 0, os.SEEK_SET)
            args += ["--file", str(fd), f"{WORKSPACE_MOUNT}/{relative}"]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return args, fds


@dataclass(frozen=True)
class Report:
    """What the supervisor sent back; `started` False means the sandbox never ran the program."""

    started: bool = False
    exit_code: int | None = None
    timed_out: bool = False
    files: dict[str, bytes] | None = None
    skipped: list[str] = field(default_factory=list)
    unseen: frozenset[str] = frozenset()  # the paths the walk skipped (a directory: all under it too)
    truncated: bool = False  # the walk stopped at a limit: files not listed were not seen


def report_cap(limits: Limits) -> int:
    """The largest report of a run's files under `limits`: the files, their names, the framing and the
    entries left out."""
    return limits.max_workspace_bytes + (limits.max_files + 100) * 1024 + 65536


async def _read_report(fd: int, cap: int, into: bytearray) -> None:
    """Append the report pipe's content to `into` up to EOF, or up to `cap` (more is never sent)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    try:
        while len(into) <= cap and (chunk := await reader.read(65536)):
            into += chunk
    finally:
        transport.close()


def _display(name: bytes) -> str:
    """A file name as text: bytes that are not UTF-8 shown escaped (`\\xff`), so any answer encodes."""
    return name.decode("utf-8", "backslashreplace")


def parse_report(raw: bytes | None) -> Report:
    """Decode the supervisor's frames; a malformed or cut report keeps what came before the fault."""
    if not raw or raw[:1] != b"S":
        return Report()
    exit_code: int | None = None
    timed_out = False
    files: dict[str, bytes] = {}
    skipped: list[str] = []
    unseen: set[str] = set()
    complete = truncated = False
    position = 1
    while position < len(raw) and not complete:
        kind = raw[position : position + 1]
        position += 1
        count = {b"E": 1, b"F": 2, b"K": 2, b"T": 0, b"Z": 0}.get(kind)
        if count is None:
            break
        parts: list[bytes] = []
        for _ in range(count):
            if position + 4 > len(raw):
                break
            (size,) = struct.unpack(">I", raw[position : position + 4])
            parts.append(raw[position + 4 : position + 4 + size])
            position += 4 + size
        if len(parts) != count or position > len(raw):
            break
        if kind == b"E" and len(parts[0]) == 5:
            exit_code, flag = struct.unpack(">iB", parts[0])
            timed_out = bool(flag)
        elif kind == b"F":
            try:
                files[parts[0].decode("utf-8")] = parts[1]
            except UnicodeDecodeError:
                skipped.append(f"{_display(parts[0])} (the name is not UTF-8)")
        elif kind == b"K":
            skipped.append(f"{_display(parts[0])} ({_display(parts[1])})")
            with contextlib.suppress(UnicodeDecodeError):  # no rollout's path is under a name not UTF-8
                unseen.add(parts[0].decode("utf-8"))
        elif kind == b"T":
            truncated = True
        elif kind == b"Z":
            complete = True
    return Report(
        started=True,
        exit_code=exit_code,
        timed_out=timed_out,
        files=files if complete else None,
        skipped=skipped,
        unseen=frozenset(unseen),
        truncated=truncated,
    )


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    try:
        if data:
            stream.write(data)
            await stream.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        stream.close()


async def _read_capped(stream: asyncio.StreamReader, cap: int, overflow: asyncio.Event) -> Output:
    kept = bytearray()
    total = 0
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            break
        if len(kept) < cap:
            kept += chunk[: cap - len(kept)]
        if total <= HARD_OUTPUT_BYTES:
            total += len(chunk)
        else:
            overflow.set()  # the run is stopped; what it still wrote is drained until the pipe closes
    return Output(bytes(kept), min(total, HARD_OUTPUT_BYTES))


def kill_process(process: asyncio.subprocess.Process) -> None:
    """SIGKILL to a process asyncio started, not yet known to have ended. Not `process.kill()`: it polls
    the process first (`Popen.send_signal`), and a poll that finds it ended reaps it, under the feet of
    the child watcher, whose own wait then fails and reports the exit status as 255."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def remove_tree(path: Path) -> None:
    """Remove `path` and all under it, however deep, holding one directory open at a time; never raises.

    Iterative and relative to directory descriptors: no recursion limit and no path-length limit, and
    a directory a run made unreadable is opened up first. What cannot be removed is logged and left.
    """
    try:
        _remove_tree(path)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


def _open_directory(name: str, parent: int) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        return os.open(name, flags, dir_fd=parent)
    except PermissionError:
        os.chmod(name, 0o700, dir_fd=parent, follow_symlinks=False)
        return os.open(name, flags, dir_fd=parent)


def _remove_tree(path: Path) -> None:
    try:
        top = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    current = top
    names: list[str] = []  # the way down from `path.parent`
    try:
        current = _open_directory(path.name, top)
        names.append(path.name)
        while names:
            descended = False
            with os.scandir(current) as entries:
                listing = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
            for name, is_directory in listing:
                if not is_directory:
                    os.unlink(name, dir_fd=current)
                    continue
                try:
                    os.rmdir(name, dir_fd=current)
                except OSError:  # not empty (or not searchable): go down into it
                    child = _open_directory(name, current)
                    os.close(current)
                    current = child
                    names.append(name)
                    descended = True
                    break
            if descended:
                continue
            # Empty now: go back up and remove it.
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=current)
            os.close(current)
            current = parent
            os.rmdir(names.pop(), dir_fd=current)
    finally:
        os.close(current)
        if current != top:
            os.close(top)


def _sweep_roots(directory: Path) -> None:
    """Remove the directories of workers that are gone, with whatever workspaces they left."""
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            match = _ROOT_NAME.fullmatch(entry.name)
            if match is None or entry.is_symlink() or not entry.is_dir():
                continue
            if match.group(1) is not None:
                gone = not owner_alive(match.group(1))
            else:  # named before roots carried their worker: swept once nothing changed them for a while
                gone = time.time() - entry.stat().st_mtime > UNNAMED_ROOT_AGE_SECONDS
            if gone:
                remove_tree(entry)


def create(
    mode: SandboxMode,
    *,
    python: Path | None,
    home: Path,
    containment: Containment | None = None,
) -> Sandbox:
    """Build the sandbox of `mode`; SandboxUnavailable with what to install or allow if it cannot run here.

    The caller owns it: `close()` it when done (the code pack's lifespan does, when the app stops).
    Sweeps what workers that are gone left behind, and finds how each run's memory can be capped.
    """
    containment = containment or Containment()
    isolated = mode == "bwrap"
    bwrap = shutil.which("bwrap") if isolated else None
    if isolated and bwrap is None:
        raise SandboxUnavailable(f"bwrap (bubblewrap) is not installed: {INSTALL_HELP}")
    interpreter = find_python(python, for_other_uid=isolated and os.geteuid() == 0)
    temp = Path(tempfile.gettempdir())
    _sweep_roots(temp)
    identity = process_identity(os.getpid()) or f"{os.getpid()}-0"
    root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{identity}-", dir=temp))
    os.chmod(root, 0o711)  # the sandbox user (when the server is root) must reach its workspace
    memory_cap, why_not = detect_memory_cap(containment.memory_bytes)
    if memory_cap.per_run:
        log.info(
            "code sandbox: each run's memory is capped at %d bytes for all its processes (%s)",
            containment.memory_bytes,
            memory_cap.mechanism,
        )
    else:
        log.warning(
            "code sandbox: no cgroup memory controller this server may use (%s); each process of a run is "
            "capped at %d bytes of address space instead, not the run as a whole",
            why_not,
            containment.memory_bytes,
        )
    freezer, why_signals = detect_freezer(memory_cap)
    if freezer.mechanism == "signals":
        log.warning(
            "code sandbox: no cgroup v2 freezer this server may use (%s); an interpreter's processes are "
            "stopped between calls by signals, which a cell that has SIGCONT sent to them can escape",
            why_signals,
        )
    else:
        log.info("code sandbox: interpreters are frozen between calls by a cgroup (%s)", freezer.mechanism)
    sandbox = Sandbox(
        isolated=isolated,
        python=interpreter,
        bwrap=bwrap,
        prlimit=shutil.which("prlimit"),
        root=root,
        containment=containment,
        memory_cap=memory_cap,
        freezer=freezer,
    )
    return sandbox


async def probe(sandbox: Sandbox) -> None:
    """Run a trivial program; SandboxUnavailable with bwrap's own message and the fix if it fails.

    If it fails only inside its cgroup, the sandbox falls back to per-process limits, with a warning.
    """
    program = ["-I", "-c", "import sys; print(sys.version_info[0])"]
    try:
        try:
            result = await sandbox.run({}, program, limits=Limits())
        except (OSError, SandboxUnavailable) as exc:
            if not sandbox.memory.per_run:
                raise
            log.warning(
                "code sandbox: a run cannot start in a cgroup here (%s); each process of a run is capped "
                "at %d bytes of address space instead, not the run as a whole",
                exc,
                sandbox.containment.memory_bytes,
            )
            sandbox.memory = MemoryCap("rlimit")
            if sandbox.freezer.mechanism != "signals":
                # Joining a cgroup is what failed: an interpreter would fail to start in its freezer's.
                log.warning("code sandbox: interpreters are not stopped between calls here (no cgroup)")
                sandbox.freezer = Freezer("signals")
            result = await sandbox.run({}, program, limits=Limits())
    except (OSError, SandboxUnavailable) as exc:
        raise SandboxUnavailable(f"the {sandbox.mode} sandbox cannot start ({exc}): {INSTALL_HELP}") from exc
    if result.exit_code != 0 or result.stdout.data.strip() != b"3":
        detail = (result.stderr.data or result.stdout.data).decode("utf-8", "replace").strip()[:500]
        raise SandboxUnavailable(
            f"the {sandbox.mode} sandbox cannot run Python here (exit {result.exit_code}: "
            f"{detail or 'no output'}): {INSTALL_HELP}"
        )
