"""Running untrusted Python: a small interface and its one real implementation, bubblewrap.

Every run gets a fresh directory holding the workspace's files, mounted at `/workspace` in a new user,
pid, network, ipc, uts and mount namespace (no network device but loopback, so no network at all),
with the system directories read-only, a private size-capped `/tmp`, an unprivileged uid, rlimits
(CPU seconds, address space, processes, open files, file size) and a wall-clock timeout that kills the
whole process tree. Nothing a run does reaches the server's process: it only reads the run's output,
exit status and the files left in the directory, and checks them itself.

`unsafe-local` runs the same commands without isolation, for local development on machines without
user namespaces; the server refuses it on a non-loopback address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

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
    """The sandbox cannot run code here (bwrap missing or unable to create namespaces)."""


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 1024 * 1024 * 1024  # address space
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
    exit_code: int | None  # None when the run was killed (timeout, output overflow)
    stdout: Output
    stderr: Output
    wall_seconds: float
    timed_out: bool = False
    output_overflow: bool = False
    files: dict[str, bytes] | None = None  # the workspace after the run, when collected
    skipped: list[str] = field(default_factory=list)  # files left behind but not kept, with the reason


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
        max_parallel: int,
    ) -> None:
        self.isolated = isolated
        self.python = python
        self.bwrap = bwrap
        self.prlimit = prlimit
        self.root = root
        self.switch_user = isolated and os.geteuid() == 0
        self.setpriv = shutil.which("setpriv") if self.switch_user else None
        self.max_parallel = max_parallel
        # One semaphore for the sandbox's life: its owner (the code pack's lifespan) runs on one event loop.
        self._slots = asyncio.Semaphore(max_parallel)
        self._mounts = self._system_mounts() if isolated else []

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

    def _command(self, workspace: Path, python_args: Sequence[str], limits: Limits, cwd: str) -> list[str]:
        inside = WORKSPACE_MOUNT if self.isolated else str(workspace)
        args = [inside if arg == WORKSPACE_ARG else arg for arg in python_args]
        command = [str(self.python), *args]
        if self.prlimit is not None:
            command = [
                self.prlimit,
                f"--cpu={limits.cpu_seconds}",
                f"--as={limits.memory_bytes}",
                f"--nofile={limits.open_files}",
                f"--fsize={limits.file_bytes}",
                "--core=0",
                # The process limit counts every process of the uid: per sandbox only under bwrap.
                *([f"--nproc={limits.processes}"] if self.isolated else []),
                "--",
                *command,
            ]
        if not self.isolated:
            return command
        assert self.bwrap is not None
        return [
            self.bwrap,
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
            *self._mounts,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(limits.tmp_bytes),
            "--tmpfs",
            "/tmp",
            "--bind",
            str(workspace),
            WORKSPACE_MOUNT,
            "--remount-ro",
            "/",
            "--chdir",
            WORKSPACE_MOUNT if cwd == "workspace" else "/",
            "--",
            *command,
        ]

    def _materialize(self, files: Mapping[str, str | bytes]) -> Path:
        workspace = Path(tempfile.mkdtemp(prefix="ws-", dir=self.root))
        for relative, content in files.items():
            path = workspace / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        if self.switch_user:
            for directory, dirnames, filenames in os.walk(workspace):
                for name in [*dirnames, *filenames]:
                    os.chown(os.path.join(directory, name), UNPRIVILEGED_ID, UNPRIVILEGED_ID)
            os.chown(workspace, UNPRIVILEGED_ID, UNPRIVILEGED_ID)
        return workspace

    async def run(
        self,
        files: Mapping[str, str | bytes],
        python_args: Sequence[str],
        *,
        limits: Limits,
        stdin: bytes = b"",
        collect: bool = False,
        cwd: Literal["workspace", "root"] = "workspace",
    ) -> RunResult:
        """Run `python <python_args>` on a fresh copy of `files`; with `collect`, read the files back."""
        async with self._slots:
            workspace = await asyncio.to_thread(self._materialize, files)
            try:
                result = await self._run(workspace, python_args, limits, stdin, cwd)
            except BaseException:
                await asyncio.to_thread(_remove_tree, workspace)
                raise
            kept, skipped = await asyncio.to_thread(_collect_and_remove, workspace, limits, collect)
            if collect:
                result = RunResult(**{**result.__dict__, "files": kept, "skipped": skipped})
            return result

    async def _run(
        self, workspace: Path, python_args: Sequence[str], limits: Limits, stdin: bytes, cwd: str
    ) -> RunResult:
        command = self._command(workspace, python_args, limits, cwd)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workspace), "LANG": "C.UTF-8"}
        user: dict[str, Any] = {}
        if self.switch_user and self.setpriv is not None:
            # setpriv drops to the unprivileged uid in the child, so the server forks cheaply (vfork)
            command = [self.setpriv, *_SETPRIV_ARGS, "--", *command]
        elif self.switch_user:
            user = {"user": UNPRIVILEGED_ID, "group": UNPRIVILEGED_ID, "extra_groups": []}
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=str(workspace),
            env=env,
            start_new_session=True,  # its own process group: one kill reaches the whole tree
            **user,
        )
        overflow = asyncio.Event()
        assert process.stdout is not None and process.stderr is not None and process.stdin is not None
        readers = [
            asyncio.ensure_future(_read_capped(process.stdout, limits.output_bytes, overflow)),
            asyncio.ensure_future(_read_capped(process.stderr, limits.output_bytes, overflow)),
        ]
        writer = asyncio.ensure_future(_feed(process.stdin, stdin))
        waiter = asyncio.ensure_future(process.wait())
        stopper = asyncio.ensure_future(overflow.wait())
        timed_out = False
        try:
            done, _ = await asyncio.wait(
                {waiter, stopper}, timeout=limits.wall_seconds, return_when="FIRST_COMPLETED"
            )
            if waiter not in done:
                timed_out = not overflow.is_set()
                _kill_group(process.pid)
            await waiter
        finally:
            _kill_group(process.pid)  # whatever the run left in its group (the pid namespace is gone already)
            if not waiter.done():
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await waiter
            stopper.cancel()
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await writer
        stdout, stderr = await asyncio.gather(*readers)
        wall = time.perf_counter() - started
        killed = timed_out or overflow.is_set()
        return RunResult(
            exit_code=None if killed else process.returncode,
            stdout=stdout,
            stderr=stderr,
            wall_seconds=wall,
            timed_out=timed_out,
            output_overflow=overflow.is_set(),
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


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _remove_tree(path: Path) -> None:
    def allow(function: object, name: str, _exc: object) -> None:
        # A run may leave directories without write or search permission: open them up and go again.
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(name), 0o700)
            os.chmod(name, 0o700)
        with contextlib.suppress(OSError):
            if os.path.isdir(name) and not os.path.islink(name):
                shutil.rmtree(name, ignore_errors=True)
            else:
                os.unlink(name)

    shutil.rmtree(path, onerror=allow)


def _collect_and_remove(workspace: Path, limits: Limits, collect: bool) -> tuple[dict[str, bytes], list[str]]:
    try:
        return collect_files(workspace, limits) if collect else ({}, [])
    finally:
        _remove_tree(workspace)


def collect_files(workspace: Path, limits: Limits) -> tuple[dict[str, bytes], list[str]]:
    """Regular files under `workspace` (no links, no special files, no `__pycache__`), within the limits."""
    kept: dict[str, bytes] = {}
    skipped: list[str] = []
    total = 0
    for directory, dirnames, filenames in os.walk(workspace, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            full = os.path.join(directory, name)
            relative = os.path.relpath(full, workspace)
            try:
                info = os.lstat(full)
            except OSError:
                continue
            if not stat.S_ISREG(info.st_mode):
                skipped.append(f"{relative} (not a regular file)")
                continue
            if len(kept) >= limits.max_files:
                skipped.append(f"{relative} (over the limit of {limits.max_files} files)")
                continue
            if total + info.st_size > limits.max_workspace_bytes:
                skipped.append(f"{relative} (over the workspace limit of {limits.max_workspace_bytes} bytes)")
                continue
            try:
                fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                skipped.append(f"{relative} (unreadable)")
                continue
            with os.fdopen(fd, "rb") as handle:
                content = handle.read(limits.max_workspace_bytes - total + 1)
            if total + len(content) > limits.max_workspace_bytes:
                skipped.append(f"{relative} (over the workspace limit of {limits.max_workspace_bytes} bytes)")
                continue
            kept[relative] = content
            total += len(content)
    return kept, skipped


def create(mode: SandboxMode, *, python: Path | None, home: Path, max_parallel: int | None = None) -> Sandbox:
    """Build the sandbox of `mode`; SandboxUnavailable with what to install or allow if it cannot run here.

    The caller owns it: `close()` it when done (the code pack's lifespan does, when the app stops)."""
    isolated = mode == "bwrap"
    bwrap = shutil.which("bwrap") if isolated else None
    if isolated and bwrap is None:
        raise SandboxUnavailable(f"bwrap (bubblewrap) is not installed: {INSTALL_HELP}")
    interpreter = find_python(python, for_other_uid=isolated and os.geteuid() == 0)
    root = Path(tempfile.mkdtemp(prefix="sparring-code-"))
    os.chmod(root, 0o711)  # the sandbox user (when the server is root) must reach its workspace
    sandbox = Sandbox(
        isolated=isolated,
        python=interpreter,
        bwrap=bwrap,
        prlimit=shutil.which("prlimit"),
        root=root,
        max_parallel=max_parallel or max(2, 2 * (os.cpu_count() or 1)),
    )
    return sandbox


async def probe(sandbox: Sandbox) -> None:
    """Run a trivial program; SandboxUnavailable with bwrap's own message and the fix if it fails."""
    try:
        result = await sandbox.run(
            {}, ["-I", "-c", "import sys; print(sys.version_info[0])"], limits=Limits()
        )
    except OSError as exc:
        raise SandboxUnavailable(f"the {sandbox.mode} sandbox cannot start ({exc}): {INSTALL_HELP}") from exc
    if result.exit_code != 0 or result.stdout.data.strip() != b"3":
        detail = (result.stderr.data or result.stdout.data).decode("utf-8", "replace").strip()[:500]
        raise SandboxUnavailable(
            f"the {sandbox.mode} sandbox cannot run Python here (exit {result.exit_code}: "
            f"{detail or 'no output'}): {INSTALL_HELP}"
        )
