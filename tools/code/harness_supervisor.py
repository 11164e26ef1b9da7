"""The run's supervisor, inside the sandbox (never imported by the server): starts the program, reports back.

`python -I -c <this> REPORT_FD WALL_SECONDS COLLECT MAX_FILES MAX_BYTES ISOLATED WORKSPACE -- ARGS...`

It writes `S` to the report pipe (the sandbox started: anything after is the run's own doing), runs
`python ARGS...` with the run's stdin, stdout and stderr, stops it (and every process it left) at the
wall-clock limit (one the kernel stopped at its CPU-time limit counts as timed out too), then sends the
exit status and, with COLLECT, the workspace's regular files within the limits: the workspace is a
tmpfs that vanishes with the sandbox, so this is the only way files come back. The walk is iterative
and bounded (depth by the path length a workspace path may have, entries by a count), so no tree a run
builds can exhaust it. The server trusts nothing in the report: it is framed, capped and checked again
there.

Frames, a kind byte then parts each with a u32 length: `S`; `E` (exit code int32, timed-out byte); `F`
name, content; `K` name, reason (an entry not kept); `T` the walk stopped at a limit (entries not seen
are neither kept nor deleted); `Z` the end.
"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import stat
import struct
import subprocess
import sys
from typing import BinaryIO

MAX_PATH_BYTES = 200  # a longer relative path is no workspace path: its subtree is not read
MAX_ENTRIES = 5000  # directory entries looked at, at most
MAX_SKIPPED = 50  # entries reported as not kept, at most
PR_SET_DUMPABLE = 4


LIMIT_SIGNALS = (signal.SIGKILL, signal.SIGXCPU)  # what the kernel sends at the CPU-time limit


def over_cpu(code: int, seconds: float, limit: float) -> bool:
    """Whether a program that ended with status `code` (negative: the signal) after `seconds` of CPU time
    of its own was stopped by its CPU-time limit: the kernel sends SIGXCPU at the soft limit and SIGKILL
    at the hard one (they are equal here). Such a run is as timed out as one stopped by the wall clock,
    whichever of the two came first."""
    if -code not in LIMIT_SIGNALS or limit <= 0:
        return False
    return seconds >= limit - 0.1


def own_cpu_seconds(ended: os.waitid_result) -> float | None:
    """The CPU time of the ended, not yet reaped process `ended` names (seen by waitid with WNOWAIT),
    itself, all its threads: the limit is its own (the children it waited for had limits of their own,
    and their time is not its). Read only when a signal of its CPU-time limit ended it (otherwise
    `over_cpu` says no whatever the time). None then too where /proc cannot tell: the caller takes the
    rusage of the reaping, which counts those children."""
    if ended.si_code not in (os.CLD_KILLED, os.CLD_DUMPED) or ended.si_status not in LIMIT_SIGNALS:
        return None
    try:
        with open(f"/proc/{ended.si_pid}/stat", "rb") as stat_file:
            fields = stat_file.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def send(report: BinaryIO, kind: bytes, *parts: bytes) -> None:
    frame = kind
    for part in parts:
        frame += struct.pack(">I", len(part)) + part
    report.write(frame)


class Walk:
    """The workspace's regular files, breadth first, within the limits; what is left out, with why.

    It never follows a link: each directory is opened from its parent's descriptor and each file from
    its directory's, both with O_NOFOLLOW, so a tree that changes while it is read (a process of the run
    that is still dying, or one an interpreter's cell left running) can change what is read, never where:
    nothing outside the workspace is ever listed or read."""

    def __init__(self, report: BinaryIO, root: str, max_files: int, max_bytes: int) -> None:
        self.report = report
        self.root = root
        self.max_files = max_files
        self.max_bytes = max_bytes
        self.files = 0
        self.total = 0
        self.skipped = 0
        self.truncated = False

    def skip(self, relative: bytes, reason: str) -> None:
        self.skipped += 1
        if self.skipped <= MAX_SKIPPED:
            send(self.report, b"K", relative, reason.encode())
        else:
            self.truncated = True  # what is not reported must not look deleted to the server

    def open_directory(self, relative: bytes) -> int:
        """A descriptor of the directory `relative` (b"" the root), reached one name at a time."""
        fd = os.open(self.root, DIRECTORY_FLAGS)
        for name in relative.split(b"/") if relative else ():
            try:
                inner = os.open(name, DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            finally:
                os.close(fd)
            fd = inner
        return fd

    def listing(self, relative: bytes) -> tuple[int, list[tuple[bytes, os.DirEntry[str]]]]:
        """The directory `relative`, open, and its entries by name's bytes; its descriptor is the
        caller's to close, and is closed here if the listing fails."""
        fd = self.open_directory(relative)
        try:
            with os.scandir(fd) as entries:
                return fd, sorted(((os.fsencode(entry.name), entry) for entry in entries), key=_name)
        except BaseException:
            os.close(fd)
            raise

    def run(self) -> None:
        pending: list[bytes] = [b""]
        entries = 0
        while pending:
            directory = pending.pop(0)
            try:
                fd, listing = self.listing(directory)
            except OSError:
                self.skip(directory, "unreadable")
                continue
            try:
                for name, entry in listing:
                    entries += 1
                    relative = directory + b"/" + name if directory else name
                    if entries > MAX_ENTRIES:
                        self.truncated = True
                        return
                    if name == b"__pycache__":
                        continue
                    if len(relative) > MAX_PATH_BYTES:
                        self.skip(relative, "path too long")
                        continue
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            pending.append(relative)
                        else:
                            self.file(relative, fd, name)
                    except OSError:
                        self.skip(relative, "unreadable")
            finally:
                os.close(fd)

    def file(self, relative: bytes, directory: int, name: bytes) -> None:
        info = os.stat(name, dir_fd=directory, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode):
            self.skip(relative, "not a regular file")
            return
        if self.files >= self.max_files:
            self.skip(relative, f"over the limit of {self.max_files} files")
            return
        if self.total + info.st_size > self.max_bytes:
            self.skip(relative, f"over the workspace limit of {self.max_bytes} bytes")
            return
        content = read_upto(name, info.st_size, self.max_bytes - self.total + 1, directory)
        if self.total + len(content) > self.max_bytes:
            self.skip(relative, f"over the workspace limit of {self.max_bytes} bytes")
            return
        self.files += 1
        self.total += len(content)
        send(self.report, b"F", relative, content)


DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def read_upto(path: bytes, size: int, limit: int, directory: int | None = None) -> bytes:
    """At most `limit` bytes of the regular file at `path` (relative to the open `directory`, if given),
    whose size was `size`: the first read asks for one byte more than that (a file that grew meanwhile is
    read on), never for the whole limit (a 1 MiB buffer allocated, and given back, for every small file).
    OSError if it is no longer a regular file (a link or a pipe put in its place)."""
    fd = os.open(path, FILE_FLAGS, dir_fd=directory)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path!r} is no longer a regular file")
        chunks: list[bytes] = []
        got, want = 0, min(size + 1, limit)
        while got < limit:
            chunk = os.read(fd, want)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
            want = min(max(want, 1 << 16), limit - got)
    finally:
        os.close(fd)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _name(item: tuple[bytes, os.DirEntry[str]]) -> bytes:
    return item[0]


def _doomed() -> None:
    # The run's processes, not this one, are what the kernel kills first when the run is out of memory.
    try:
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("1000")
    except OSError:
        pass


def stop_everything(child: subprocess.Popen[bytes], isolated: bool) -> None:
    """Kill what the run started: in the sandbox's pid namespace everything but this process."""
    try:
        if isolated:
            os.kill(-1, signal.SIGKILL)
        else:
            os.killpg(child.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def ended_within(child: subprocess.Popen[bytes], seconds: float) -> tuple[bool, float | None]:
    """Whether the program ended within `seconds`, and then its own CPU time, read before it is reaped
    (None where the kernel has no pidfd: the caller counts its waited-for children too)."""
    try:
        pidfd = os.pidfd_open(child.pid)
    except (AttributeError, OSError):
        try:
            child.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False, None
        return True, None
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)  # readable once the program has ended
        if not poller.poll(seconds * 1000):
            return False, None
        ended = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # not reaped yet
        return True, None if ended is None else own_cpu_seconds(ended)
    finally:
        os.close(pidfd)


def main() -> int:
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the run cannot read or trace this process
    separator = sys.argv.index("--")
    report_fd, wall, collect, max_files, max_bytes, isolated, workspace = sys.argv[1:separator]
    args = sys.argv[separator + 1 :]
    report = os.fdopen(int(report_fd), "wb")
    send(report, b"S")
    report.flush()
    child = subprocess.Popen(
        [sys.executable, *args], preexec_fn=_doomed, start_new_session=isolated != "1", close_fds=True
    )
    timed_out = False
    ended, own = ended_within(child, float(wall))
    if not ended:
        timed_out = True
        code = -signal.SIGKILL
    else:
        code = child.wait()
        # The run's CPU-time limit is this process's own (set on the sandbox's first process).
        limit = resource.getrlimit(resource.RLIMIT_CPU)[0]
        if limit != resource.RLIM_INFINITY:
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            timed_out = over_cpu(code, usage.ru_utime + usage.ru_stime if own is None else own, limit)
    stop_everything(child, isolated == "1")
    if code < 0:
        code = 128 - code  # killed by a signal: the shell's convention
    send(report, b"E", struct.pack(">iB", code, timed_out))
    if collect == "1":
        walk = Walk(report, workspace, int(max_files), int(max_bytes))
        walk.run()
        if walk.truncated:
            send(report, b"T")
    send(report, b"Z")
    report.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
