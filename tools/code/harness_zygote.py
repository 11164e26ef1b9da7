"""The warm sandbox's parent, inside bwrap (never imported by the server): imports once, forks per run.

`python -I -B -X utf8 -c <this> CONTROL_FD WORKSPACE SUPERVISOR_SOURCE SIZES_JSON [PRECOMPILE_JSON]`

It runs as the sandbox user in bwrap's namespaces (no network, read-only system directories, the
interpreter's imports done) and talks to the server over unix sockets:

- on CONTROL_FD, `L` with a socket starts a **slot**: a fork that the server moves into the slot's memory
  cgroup once (so its runs are born in it: no per-run migration), with a user and network namespace of
  its own (a loopback, up), and that runs one run at a time;
- on a slot's socket, `N` with a socket **prepares** the next run: the slot clones the run's init (P1)
  straight into new user, mount, pid, ipc and uts namespaces, pid 1 of its own pid namespace (where
  clone(2)'s number is unknown, a keeper S unshares them and forks P1); the run sees none of another
  run's files, processes or IPC objects, and the slot's network namespace is used by its runs in turn,
  never by two at once (a fresh one after a run that used it). P1 mounts fresh size-capped tmpfs at
  `/workspace`, `/tmp` and `/dev/shm`, its own `/dev/pts` and `/proc`, forbids further user namespaces,
  drops every capability and forks the program's process (P2), which waits for the job; with `F`
  instead of `N` (the server sends it when no other run of the worker is in flight: spare CPU), P2 first
  copies the pages it shares with the parent (`prefault`), so the run does not take its page faults
  after the job arrives;
- on the run's socket, `J` with its stdin, stdout and stderr, then `u32 length` + JSON header + the
  files' bytes, **starts** it: P2 writes the files and tells P1 the run's terms, P1 answers `P` (the
  kernel attaches its pid as the server sees it) and `S`, and P2 takes the run's rlimits, stdio,
  environment, working directory, a fresh `__main__`, a reseeded `random`, then runs the code
  (`-c CODE` or a script, as `python` would).

PRECOMPILE_JSON lists sources the server runs often (the grading harness and its runner): the parent
compiles them once, and a run whose `-c CODE` is one of them execs the parent's code object instead of
compiling it again (a fork's copy: what a run does to it stays in the run). The grading harness finds
the runner's in `sys.modules["sparring_precompiled"].code` (a dict from source to code object).

P1 stops the program and everything it left at the wall-clock limit (it is pid 1: when it exits, the
kernel kills the rest; a program the kernel stopped at its CPU-time limit is timed out too), then sends
the supervisor's report (`harness_supervisor.py`'s frames: exit status and, when asked, the workspace's
files) and exits. P2's last act closes its descriptors and writes its exit status on a pipe to P1
(`say_done`): P1 then kills the run's processes and reports without waiting for the kernel to take P2
apart. A slot prepares its next run only once the last run's P1 (or S) has ended. Nothing of a run
outlives it: its namespaces and tmpfs die with its processes, and the parent's own memory is never
written by a child (fork copies it).
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import fcntl
import gc
import importlib.machinery  # imported once here (with importlib), so a run does not pay for it
import io
import json
import os
import random
import resource
import select
import signal
import socket
import struct
import subprocess  # noqa: F401  (imported once here, so a run that uses it does not pay for it)
import sys
import time
import traceback
import types
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 4, 24, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CAP_LAST = 63
SIOCSIFFLAGS, IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x8914, 0x1, 0x8, 0x40
WORKSPACE = "/workspace"
INODES = 16384  # per tmpfs of a run (the workspace, /tmp, /dev/shm): files and directories
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}

libc = ctypes.CDLL(None, use_errno=True)
_fork = ctypes.PyDLL(None, use_errno=True).fork  # the GIL held across it: this process has one thread


def bare_fork() -> int:
    """fork(2) without Python's fork hooks (a quarter of `os.fork`'s cost here), for the processes that
    run only this file's code (keepers and inits); a run's program gets `os.fork` and all of them."""
    pid = int(_fork())
    if pid < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"fork: {os.strerror(error)}")
    return pid


MADV_POPULATE_WRITE = 23  # Linux 5.14
PREFAULT_CHUNK = 1 << 20
PREFAULT_LARGEST = 64 << 20  # a larger private mapping is a reservation, mostly never touched


def prefault(sock: socket.socket) -> None:
    """Copy now the parent's pages this process shares copy-on-write, while the run waits for its job:
    each of a run's processes otherwise takes hundreds of page faults as soon as it runs Python (reference
    counts are writes), ~1.5 ms of a trivial run here. Stops as soon as the job arrives (the socket turns
    readable), so it never holds a run up by more than one chunk; a kernel without MADV_POPULATE_WRITE
    refuses the first call and nothing is done."""
    try:
        with open("/proc/self/maps") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return
    waiting = select.poll()
    waiting.register(sock.fileno(), select.POLLIN)
    for line in lines:
        fields = line.split()
        if len(fields) < 2 or fields[1] != "rw-p":
            continue
        start, end = (int(value, 16) for value in fields[0].split("-"))
        if end - start > PREFAULT_LARGEST:
            continue
        for chunk in range(start, end, PREFAULT_CHUNK):
            if waiting.poll(0):
                return
            size = min(PREFAULT_CHUNK, end - chunk)
            if libc.madvise(ctypes.c_void_p(chunk), ctypes.c_size_t(size), MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == errno.EINVAL:
                    return  # not known to this kernel
                break  # this mapping could not be populated (EFAULT, ENOMEM): the next one may


SFD_NONBLOCK, SFD_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
# The program's end of the pipe on which it tells its init its exit status (fd, st_dev, st_ino), and the
# program's pid: a process the program forked that ends the same way says nothing.
DONE: tuple[int, int, int, int] = (-1, 0, 0, 0)


def child_signals() -> int:
    """A signalfd for SIGCHLD (which the caller blocks): non-blocking, closed on exec."""
    mask = (ctypes.c_ulong * 16)()  # sigset_t: 1024 bits
    mask[0] = 1 << (signal.SIGCHLD - 1)
    fd = int(libc.signalfd(-1, ctypes.byref(mask), SFD_NONBLOCK | SFD_CLOEXEC))
    if fd < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"signalfd: {os.strerror(error)}")
    return fd


def close_all_but(first: int, kept: int) -> None:
    """Every descriptor from `first` up closed, except `kept`."""
    os.closerange(first, kept)
    os.closerange(kept + 1, 1 << 16)


def say_done(status: int) -> None:
    """The program's last act before `_exit`: every descriptor closed but the pipe to its init (its
    output ends here), then its exit status on that pipe, so the init reports while the kernel takes the
    process apart (a fork's exit costs 0.5-2 ms here). Not said when the program closed or replaced that
    descriptor: the init then learns of the exit as it would anyway."""
    fd, device, inode, pid = DONE
    if fd < 0 or os.getpid() != pid:
        return
    try:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != (device, inode):
            return
        close_all_but(0, fd)
        os.write(fd, struct.pack(">i", status))
    except OSError:
        pass


def check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def load_supervisor(source: str) -> types.ModuleType:
    module = types.ModuleType("harness_supervisor")
    exec(compile(source, "harness_supervisor.py", "exec"), module.__dict__)
    return module


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the server closed the run's socket")
        data += chunk
    return bytes(data)


def drop_capabilities() -> None:
    """No capability left in any set (the run's user namespace gave us all of them), and none to regain."""
    for cap in range(CAP_LAST + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the kernel's last capability
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    check(libc.capset(header, data), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


RUN_NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
CLONE_SYSCALL = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine)
_syscall = ctypes.PyDLL(None, use_errno=True).syscall  # the GIL held across it, as for `bare_fork`


def clone_into(flags: int) -> int:
    """clone(2) like fork, but the child starts in new namespaces (`flags`): with a new pid namespace it is
    its pid 1 at once, with no intermediate process. Raises OSError where the syscall is unknown."""
    if CLONE_SYSCALL is None:
        raise OSError(errno.ENOSYS, "clone: unknown on this architecture")
    pid = int(_syscall(CLONE_SYSCALL, ctypes.c_ulong(flags | signal.SIGCHLD), None, None, None, None))
    if pid < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"clone: {os.strerror(error)}")
    return pid


def map_identity(uid: int, gid: int) -> None:
    """In a new user namespace, keep `uid` and `gid` (this process's in the namespace above).

    Its own maps are writable only while it is dumpable; no run can see it meanwhile (runs live in pid
    namespaces of their own, below this one)."""
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"{uid} {uid} 1")
    write("/proc/self/gid_map", f"{gid} {gid} 1")
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def enter_namespaces(flags: int) -> None:
    """New namespaces (`flags`, a user namespace among them) in which this process keeps its uid and gid."""
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(flags), "unshare")
    map_identity(uid, gid)


class Run:
    """One run: its keeper (S) makes the namespaces and file systems, its init (P1) waits for the job, runs
    it and reports; the program (P2) leaves through `keep()`'s return value."""

    def __init__(
        self, sock: socket.socket, sizes: dict[str, int], supervisor: types.ModuleType, prefault: bool
    ) -> None:
        self.sock = sock
        self.prefault = prefault
        self.sizes = sizes
        self.supervisor = supervisor
        self.stdio: list[int] = []
        self.job: dict[str, Any] = {}

    def file_systems(self) -> None:
        """Fresh size-capped tmpfs at /dev/shm, /tmp and the workspace, and a fresh /dev/pts, in the run's
        mount namespace."""
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "private mounts")
        for target, size in (("/dev/shm", "shm"), ("/tmp", "tmp"), (WORKSPACE, "workspace")):
            # Inodes capped too: empty files cost no size, but each is kernel memory of the slot's cgroup.
            options = f"size={int(self.sizes[size])},nr_inodes={INODES},mode=0755".encode()
            check(libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options), target)
        # Terminals of its own, as a cold run's bwrap gives it (bwrap's /dev/ptmx leads to pts/ptmx): the
        # parent's instance would let runs going at once open each other's terminals.
        options = b"newinstance,ptmxmode=0666,mode=0620"
        check(libc.mount(b"devpts", b"/dev/pts", b"devpts", MS_NOSUID | MS_NOEXEC, options), "/dev/pts")
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    def cloned(self, uid: int, gid: int) -> dict[str, Any]:
        """P1 made by `clone_into`: already pid 1 of the run's namespaces; returns only in P2."""
        map_identity(uid, gid)
        self.file_systems()
        return self.init()

    def keep(self) -> dict[str, Any]:
        """S, where `clone_into` cannot be used: the run's namespaces by unshare(2), then P1 by a fork (a
        new pid namespace takes the children only); returns only in P2."""
        enter_namespaces(RUN_NAMESPACES)
        self.file_systems()
        init = bare_fork()
        if init == 0:
            return self.init()
        self.sock.close()
        drop_capabilities()
        os.waitpid(init, 0)
        os._exit(0)

    def receive_job(self) -> None:
        """`J` with the run's stdin, stdout and stderr, then `u32 length` + JSON header + the files' bytes."""
        message, fds, _, _ = socket.recv_fds(self.sock, 1, 3)
        if message != b"J" or len(fds) != 3:
            os._exit(0)  # the server closed it unused (its parent retires), or sent garbage
        self.stdio = fds
        (size,) = struct.unpack(">I", receive_exactly(self.sock, 4))
        self.job = json.loads(receive_exactly(self.sock, size))
        blob = receive_exactly(self.sock, int(self.job["blob"]))
        position = 0
        for relative, length in self.job["files"]:
            path = os.path.join(WORKSPACE, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as handle:
                handle.write(blob[position : position + length])
            position += length

    def init(self) -> dict[str, Any]:
        """P1: its /proc, no capabilities, the program's process forked in advance (it takes the job and
        tells P1 the run's terms when it starts); returns only in P2."""
        check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "/proc")
        write("/proc/sys/user/max_user_namespaces", "0")
        drop_capabilities()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        terms_r, terms_w = os.pipe()
        done_r, done_w = os.pipe2(os.O_CLOEXEC)
        program = os.fork()
        if program == 0:
            global DONE
            os.close(terms_r)
            os.close(done_r)
            info = os.fstat(done_w)
            DONE = (done_w, info.st_dev, info.st_ino, os.getpid())
            if self.prefault:
                prefault(self.sock)
            self.receive_job()
            terms = {key: self.job[key] for key in ("wall", "collect", "max_files", "max_bytes")}
            terms["cpu"] = self.job["limits"].get("RLIMIT_CPU", 0)
            os.write(terms_w, json.dumps(terms).encode())
            os.close(terms_w)
            return self.program_setup()
        os.close(terms_w)
        os.close(done_w)
        # Python's SIGINT handler is the only one it installs: without it, as pid 1 of the run's namespace,
        # this init takes no signal a process of the run sends it (the kernel drops what an init does not
        # handle), so no run can interrupt its own supervision. The program keeps Python's handler.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        chunks = []
        while chunk := os.read(terms_r, 65536):
            chunks.append(chunk)
        os.close(terms_r)
        if not chunks:
            self.stop_everything()
            os._exit(0)  # no job came (the server closed the run unused)
        os.set_blocking(done_r, False)
        started = time.monotonic()
        terms = json.loads(b"".join(chunks))
        report = io.BytesIO()
        report.write(b"P")  # the kernel attaches this process's pid as the server sees it
        self.supervisor.send(report, b"S")
        self.sock.sendall(report.getvalue())
        deadline = started + float(terms["wall"])
        code, timed_out, said = self.wait(program, deadline, float(terms["cpu"]), done_r)
        if said:
            # The program said its status and is exiting: the run's processes are killed and the files
            # read now (the walk never follows a link, whatever a dying process does meanwhile), and they
            # are reaped once the report is sent; the slot prepares its next run only after this init
            # has ended, so nothing of this run is left by then.
            with contextlib.suppress(ProcessLookupError):
                os.kill(-1, signal.SIGKILL)
        else:
            self.stop_everything()
        report = io.BytesIO()
        self.supervisor.send(report, b"E", struct.pack(">iB", code, timed_out))
        if terms["collect"]:
            walk = self.supervisor.Walk(report, WORKSPACE, int(terms["max_files"]), int(terms["max_bytes"]))
            walk.run()
            if walk.truncated:
                self.supervisor.send(report, b"T")
        self.supervisor.send(report, b"Z")
        self.sock.sendall(report.getvalue())
        self.sock.close()
        if said:
            self.stop_everything()
        os._exit(0)

    def wait(self, program: int, deadline: float, cpu: float, done: int) -> tuple[int, bool, bool]:
        """The program's status (the shell's convention for a signal), whether the clock stopped it (the
        wall clock, or the kernel at its CPU-time limit `cpu`), and whether the program said that status
        on `done` as its last act (it may still be exiting). Orphans (pid 1 inherits them) are reaped
        meanwhile, so they do not count as processes."""
        children = child_signals()
        waiting = select.poll()
        waiting.register(children, select.POLLIN)
        waiting.register(done, select.POLLIN)
        said = b""
        try:
            while True:
                while True:
                    try:  # who ended, left unreaped: the program's own CPU time is read before it is reaped
                        ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                    except ChildProcessError:
                        return 128 + signal.SIGKILL, False, False
                    if ended is None:
                        break
                    if ended.si_pid != program:
                        os.waitpid(ended.si_pid, 0)  # an orphan the run left
                        continue
                    seconds = self.supervisor.own_cpu_seconds(ended)
                    _, status, usage = os.wait4(program, 0)
                    if seconds is None:
                        seconds = usage.ru_utime + usage.ru_stime
                    code = os.waitstatus_to_exitcode(status)
                    timed_out = self.supervisor.over_cpu(code, seconds, cpu)
                    return (128 - code if code < 0 else code), timed_out, False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    os.kill(program, signal.SIGKILL)
                    os.waitpid(program, 0)
                    return 128 + signal.SIGKILL, True, False
                for fd, _ in waiting.poll(min(remaining, 1.0) * 1000):
                    if fd == children:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(children, 4096):
                                pass
                        continue
                    with contextlib.suppress(BlockingIOError):
                        chunk = os.read(done, 4 - len(said))
                        if not chunk:  # closed unsaid: its exit is learnt from SIGCHLD
                            waiting.unregister(done)
                        said += chunk
                        if len(said) == 4:
                            return struct.unpack(">i", said)[0] & 0xFF, False, True
        finally:
            os.close(children)
            os.close(done)

    def stop_everything(self) -> None:
        """Kill and reap every other process of the run's pid namespace (pid 1 is spared by kill(-1))."""
        for _ in range(10000):
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                return
            time.sleep(0.0005)

    def program_setup(self) -> dict[str, Any]:
        """P2, before the program: its limits, stdio, environment and directory; nothing of the parent's."""
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for name, value in self.job["limits"].items():
            resource.setrlimit(getattr(resource, name), (int(value), int(value)))
        for target, fd in enumerate(self.stdio):
            os.dup2(fd, target)
        self.sock.detach()
        close_all_but(3, DONE[0])
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        try:
            write("/proc/self/oom_score_adj", "1000")  # the run's processes die first at its memory cap
        except OSError:
            pass
        os.environ.clear()
        os.environ.update(ENV)
        os.chdir(WORKSPACE if self.job["cwd"] == "workspace" else "/")
        return self.job


def resident_bytes() -> int:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def receive(sock: socket.socket, fds: int) -> tuple[bytes, list[int]]:
    while True:
        try:
            message, received, _, _ = socket.recv_fds(sock, 1, fds)
            return message, received
        except InterruptedError:
            continue


def loopback_up() -> None:
    """The current network namespace's loopback, up."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        flags = struct.pack("16sH22x", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING)
        fcntl.ioctl(probe.fileno(), SIOCSIFFLAGS, flags)


# The namespace's own counters (its devices' traffic, its IP, ICMP, TCP and UDP statistics): a run that
# used the network at all changed one of them, a packet to nowhere included.
NETWORK_COUNTERS = ("/proc/self/net/dev", "/proc/self/net/snmp", "/proc/self/net/snmp6")


def network_counters() -> tuple[bytes, ...]:
    """The current network namespace's counters, as read (b"" for one this kernel lacks)."""
    counters = []
    for path in NETWORK_COUNTERS:
        try:
            with open(path, "rb") as counts:
                counters.append(counts.read())
        except FileNotFoundError:  # no IPv6 here
            counters.append(b"")
    return tuple(counters)


def network_used(fresh: tuple[bytes, ...]) -> bool:
    """Whether a run left anything in the slot's network namespace, or used it at all: a socket still
    there (`sockets: used`, per namespace; a closed TCP connection waiting in TIME_WAIT, `tw`) or any of
    its counters moved since the namespace was made (`fresh`, `network_counters()` then). Read from the
    namespace's own counts (`/proc/self/net/tcp` would walk the kernel's whole connection table: ~4 ms
    here); True when they cannot be read."""
    try:
        counts: dict[bytes, int] = {}
        with open("/proc/self/net/sockstat", "rb") as sockstat:
            for line in sockstat:
                fields = line.split()
                for name, value in zip(fields[1::2], fields[2::2], strict=False):
                    counts[fields[0] + name] = int(value)
        return bool(counts[b"sockets:used"] or counts[b"TCP:tw"]) or network_counters() != fresh
    except (OSError, KeyError, ValueError, IndexError):
        return True


def serve_slot(sock: socket.socket, sizes: dict[str, int], supervisor: types.ModuleType) -> dict[str, Any]:
    """A slot: one run at a time (the server moved it into the slot's memory cgroup, which its runs
    inherit); `N` with a socket prepares the next run. Returns only in a run's program (P2)."""
    # The slot's own network namespace (a loopback, up): its runs, one at a time, use it in turn; no two
    # slots share one. A run that used it at all gets the next run a fresh one: a TCP connection it closed
    # waits there (TIME_WAIT, a minute) and would refuse the next run a bind to its port, a unix socket it
    # bound may outlive it for a moment, and the loopback's counters would carry what it sent to the next
    # run. Making one per run would cost ~1 ms a run, for the few runs that use the network at all.
    enter_namespaces(CLONE_NEWUSER | CLONE_NEWNET)
    loopback_up()
    fresh = network_counters()
    sock.sendall(b"Y")  # the kernel attaches this process's pid: the server moves it into its cgroup
    # A run is prepared only once the last one's init (or keeper) has ended: its processes, their memory
    # (charged to the slot's cgroup) and its file systems are gone by then, whenever its report was sent.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    last = 0
    cloning = CLONE_SYSCALL is not None
    while True:
        message, fds = receive(sock, 1)
        if not message:
            os._exit(0)
        if message not in (b"N", b"F") or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            continue
        if last:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(last, 0)
            if network_used(fresh):
                check(libc.unshare(CLONE_NEWNET), "a fresh network namespace")
                loopback_up()
                fresh = network_counters()
        uid, gid = os.getuid(), os.getgid()
        try:
            init = clone_into(RUN_NAMESPACES) if cloning else bare_fork()
        except OSError:  # clone is unknown here, or refused: a keeper does it in two steps from now on
            cloning = False
            init = bare_fork()
        if init == 0:
            try:
                sock.close()
                run = Run(socket.socket(fileno=fds[0]), sizes, supervisor, prefault=message == b"F")
                return run.cloned(uid, gid) if cloning else run.keep()
            except BaseException:  # the run could not be set up: the server sees its socket close
                traceback.print_exc()
                os._exit(70)
        os.close(fds[0])
        last = init


def serve(control: socket.socket, sizes: dict[str, int], supervisor: types.ModuleType) -> dict[str, Any]:
    """The parent's loop: `L` with a socket starts a slot. Returns only in a run's program (P2)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # slots and keepers are reaped by the kernel
    control.sendall(b"Y" + struct.pack(">Q", resident_bytes()))
    while True:
        message, fds = receive(control, 1)
        if not message:
            os._exit(0)  # the server closed the parent: it retires
        if message != b"L" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            continue
        slot = os.fork()
        if slot == 0:
            control.close()
            return serve_slot(socket.socket(fileno=fds[0]), sizes, supervisor)
        os.close(fds[0])


def fresh_stdio() -> None:
    """The standard streams on the run's fds 0, 1 and 2, as `python` opens them (UTF-8 mode)."""
    streams: dict[str, Any] = {
        "stdin": open(0, "rb", closefd=False),
        "stdout": open(1, "wb", closefd=False),
        "stderr": open(2, "wb", closefd=False),
    }
    for name, binary in streams.items():
        errors = "backslashreplace" if name == "stderr" else "surrogateescape"
        text = io.TextIOWrapper(binary, encoding="utf-8", errors=errors, line_buffering=name == "stderr")
        setattr(sys, name, text)
        setattr(sys, f"__{name}__", text)


PRECOMPILED: dict[str, types.CodeType] = {}  # source -> its code object, compiled as `-c` compiles it


def precompile(sources: list[str]) -> None:
    """Compile `sources` once, and publish them as `sys.modules["sparring_precompiled"].code`."""
    for source in sources:
        PRECOMPILED[source] = compile(source, "<string>", "exec", dont_inherit=True)
    module = types.ModuleType("sparring_precompiled")
    module.__dict__["code"] = PRECOMPILED
    sys.modules[module.__name__] = module


def program(job: dict[str, Any], base_path: list[str]) -> int:
    """P2: runs `-c CODE args` or `PATH args` as `python` would, in a fresh `__main__`; its exit status."""
    fresh_stdio()
    random.seed()  # a fork copies the parent's generator: each run draws its own
    gc.enable()
    argv: list[str] = job["argv"]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    if job["code"] is not None:
        filename = "<string>"
        sys.argv = ["-c", *argv]
        first = ""
        main.__dict__["__loader__"] = importlib.machinery.BuiltinImporter  # as `python -c` sets it
    else:
        filename = os.path.abspath(argv[0])
        loader = importlib.machinery.SourceFileLoader("__main__", filename)
        main.__dict__.update({"__file__": filename, "__cached__": None, "__loader__": loader})
        sys.argv = list(argv)
        first = os.path.dirname(filename)
    sys.path[:] = base_path if job["isolated"] else [first, *base_path]
    sys.modules["__main__"] = main
    sys.path_importer_cache.clear()
    code = None
    try:
        if job["code"] is None:
            with open(filename, "rb") as handle:
                source: str | bytes = handle.read()
        else:
            source = job["code"]
            code = PRECOMPILED.get(job["code"])
        if code is None:
            code = compile(source, filename, "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except SystemExit as exit:
        return exit_status(exit)
    except BaseException as error:
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code is not code:  # the parent's frames are not the run's
            tb = tb.tb_next
        error.__traceback__ = tb
        try:
            sys.excepthook(type(error), error, tb)
        except BaseException:
            pass
        return 1
    return 0


def finish(status: int, own_code: bool) -> int:
    """What the interpreter's exit does that a run can see, without tearing down every module the parent
    imported (most of a fork's cost): non-daemon threads joined, atexit functions run, the files the
    program left open flushed (wherever it left them: a module it imported, one of the parent's; not for
    `own_code`, this project's harness, which closes its own), its `__main__` released, the standard
    streams flushed."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as exit:
        status = exit_status(exit)
    except BaseException:
        pass
    if not own_code:
        threading = sys.modules.get("threading")
        if threading is not None and threading.active_count() > 1:
            # A daemon thread left blocked in a write holds its file's lock: python's exit abandons it
            # and never flushes that file, so the flush here is given a moment, not the run's time.
            flusher = threading.Thread(target=flush_files, daemon=True)
            flusher.start()
            flusher.join(FLUSH_SECONDS)
        else:
            flush_files()
    main = sys.modules.get("__main__")
    if main is not None:
        main.__dict__.clear()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            if stream is sys.stdout and status == 0:
                status = 120  # as `python` answers when it cannot flush its output
    return status


FLUSH_SECONDS = 0.5  # for the files left open at a run's exit, while other threads of it still run
# The buffered file objects whose data a flush writes (text before binary: text writes to its buffer).
BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)


def flush_files() -> None:
    """Flush the files the run opened that are still open, as `python`'s exit leaves them written: the
    objects the collector tracks, made since the parent froze its own (`gc.freeze`)."""
    try:
        found = [item for item in gc.get_objects() if isinstance(item, BUFFERED)]
    except BaseException:
        return
    found.sort(key=lambda item: not isinstance(item, io.TextIOWrapper))
    for item in found:
        try:
            if item is not sys.stdout and item is not sys.stderr and not item.closed:
                item.flush()
        except BaseException:
            pass


def exit_status(exit: SystemExit) -> int:
    code = exit.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except BaseException:
        pass
    return 1


def main() -> None:
    control_fd, _, supervisor_source, sizes_json = sys.argv[1:5]
    precompile(json.loads(sys.argv[5]) if len(sys.argv) > 5 else [])
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no run can read or trace the parent, its keepers or inits
    base_path = list(sys.path)
    control = socket.socket(fileno=int(control_fd))
    supervisor = load_supervisor(supervisor_source)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    gc.collect()
    gc.freeze()  # what the parent holds stays shared with its children, never copied by the collector
    job = serve(control, json.loads(sizes_json), supervisor)
    del control, supervisor
    status = finish(program(job, base_path), own_code=job["code"] in PRECOMPILED)
    say_done(status)
    os._exit(status)


main()
