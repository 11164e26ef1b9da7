"""The persistent interpreter's driver, inside the sandbox (never imported by the server).

`python -I -S -B -c <this> FRAME_FD WORKSPACE SUPERVISOR_SOURCE`

Runs the cells of one rollout in one namespace, like a notebook kernel. Requests arrive on stdin, answers
leave on FRAME_FD, a pipe of its own: each frame is a u32 big-endian length, then that many bytes of
UTF-8 JSON. The driver moves both pipes to private descriptors (not inherited by anything a cell starts)
and points fds 0, 1 and 2 at /dev/null; during a cell, fds 1 and 2 are memory files whose first bytes
(and size) the answer carries, so whatever a cell prints (from Python, C or a child process) is output,
never a frame. A cell can still write to the frame pipe on purpose; the server trusts nothing in a
frame (capped, checked, a malformed one or one of another request's id stops the interpreter),
so the worst it forges is its own answer.

Request: `{"id", "code", "files": {path: text or null}, "output_bytes", "max_files", "max_bytes",
"seconds"}`; `files` are the rollout's workspace changes to apply first (null: delete); `seconds` the
call's time, within which showing the value of its last expression is given up. The driver first answers
`{"ready": true}`; each cell answers `{"id"` (the request's), `"stdout", "stderr"` (base64 of the
first bytes), `"stdout_total", "stderr_total", "value"` (repr of a last expression, or null),
`"exception"` (a traceback, or null), `"files"` (base64 of the supervisor's report frames: the
workspace after the cell)`}`.

A grade's check (`{"id", "check": {"test", "entry_point", "prompt"}, "seconds", "files"}`) runs in a
fork of the driver: the fork sees the namespace the cells built (a copy-on-write copy, so nothing it
changes reaches the interpreter), runs the test code in it and, when `entry_point` is given, calls the
test's `check(<the namespace's entry point>)`. The driver keeps a copy of the workspace first, then
places `files` (the rollout's changes since the last cell: the check sees its final files); when the fork
ends (or is killed at `seconds`) it stops every process the check left (orphans come back to the driver,
a child subreaper, while the check runs) and puts the workspace back exactly as it was. It answers
`{"id", "passed", "error"` (why not, or null), `"timed_out", "restored"}` (false if the workspace could
not be put back: the server then stops this interpreter), and `"not_placed"` as a cell does.
"""

from __future__ import annotations

import ast
import base64
import builtins
import contextlib
import ctypes
import errno
import importlib
import io
import json
import linecache
import os
import select
import signal
import stat
import struct
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

REPR_CHARS = 16 * 1024
MAX_NOT_PLACED = 100
CHECK_NOT_PLACED = 20  # a check's answer is a small frame: its first few are enough to flag the grade
TRACEBACK_CHARS = 16 * 1024
CHECK_ERROR_CHARS = 4000
PR_SET_CHILD_SUBREAPER = 36
STOP_ROUNDS = 64  # passes over the check's leftover processes (each may have started more)


def load_module(name: str, source: str) -> types.ModuleType:
    """A harness's code (`harness_supervisor`'s walk, `harness_main`'s proxy, `harness_runner`'s values)
    as a module; its `if __name__ == "__main__"` part does not run."""
    module = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    return module


def read_frame(fd: int) -> dict[str, Any] | None:
    """The next request frame on `fd` as JSON (None at its end)."""
    header = read_exactly(fd, 4)
    if header is None:
        return None
    body = read_exactly(fd, struct.unpack(">I", header)[0])
    if body is None:
        return None
    message = json.loads(body)
    return message if isinstance(message, dict) else {}


def read_exactly(fd: int, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def send(fd: int, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode("utf-8")
    view = memoryview(struct.pack(">I", len(body)) + body)
    while view:
        view = view[os.write(fd, view) :]


DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO a cell left where a file goes fails at once instead of waiting for a reader.
WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def apply_files(workspace: str, files: dict[str, str | None]) -> list[list[str]]:
    """The rollout's changes to its files since the last cell (written by other tools, or deleted), placed
    one name at a time from the workspace's descriptor, never through a link a cell made: what stands in a
    file's way (a link, a FIFO, a read-only file, a directory, a file where a directory goes) is replaced,
    as the rollout's files win, and a directory a cell made read-only is made writable again. Answers
    `[path, why]` for each that could not be placed."""
    if not files:
        return []
    try:
        root = os.open(workspace, DIRECTORY)
    except PermissionError:  # a cell made the workspace itself unreadable
        try:
            os.chmod(workspace, 0o755)
            root = os.open(workspace, DIRECTORY)
        except OSError as error:
            return [[relative, error.strerror or str(error)] for relative in files]
    except OSError as error:  # no descriptor left (a cell holds them all), say
        return [[relative, error.strerror or str(error)] for relative in files]
    failed = []
    try:
        for relative, content in files.items():
            try:
                place(root, relative.split("/"), content)
            except (OSError, RecursionError, UnicodeError) as error:
                failed.append([relative, getattr(error, "strerror", None) or str(error)])
    finally:
        os.close(root)
    return failed


def place(root: int, parts: list[str], content: str | None) -> None:
    """Write `content` at `parts` under the directory `root` (None: delete the file there)."""
    directory = os.dup(root)
    try:
        for name in parts[:-1]:
            inner = enter(directory, name, make=content is not None)
            if inner < 0:
                return  # a file under a name that is no directory here: nothing of it to delete
            os.close(directory)
            directory = inner
        name = parts[-1]
        try:
            info: os.stat_result | None = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            info = None
        if content is None:
            if info is not None and not stat.S_ISDIR(info.st_mode):
                writable(directory, lambda: os.unlink(name, dir_fd=directory))
            return
        data = content.encode("utf-8")
        if info is not None and not (stat.S_ISREG(info.st_mode) and info.st_mode & stat.S_IWUSR):
            remove(directory, name, info)
        target = writable(directory, lambda: os.open(name, WRITE, 0o644, dir_fd=directory))
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(target, view) :]
        finally:
            os.close(target)
    finally:
        os.close(directory)


def writable(directory: int, step: Callable[[], T]) -> T:
    """`step()`, again after making `directory` writable and searchable if it was refused."""
    try:
        return step()
    except PermissionError:
        os.fchmod(directory, 0o755)
        return step()


def enter(directory: int, name: str, *, make: bool) -> int:
    """The directory `name` in `directory`, opened (made when missing, or in place of what is there when
    `make`); -1 when it is not there and not to be made."""
    try:
        return writable(directory, lambda: os.open(name, DIRECTORY, dir_fd=directory))
    except FileNotFoundError:
        if not make:
            return -1
    except PermissionError:  # a directory a cell made unreadable
        os.chmod(name, 0o755, dir_fd=directory)
        return os.open(name, DIRECTORY, dir_fd=directory)
    except OSError as error:
        if error.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise  # no descriptor left, say: what is there is left as it is
        if not make:
            return -1  # a file or a link where the directory goes
        remove(directory, name, os.stat(name, dir_fd=directory, follow_symlinks=False))
    writable(directory, lambda: os.mkdir(name, 0o755, dir_fd=directory))
    return os.open(name, DIRECTORY, dir_fd=directory)


def remove(directory: int, name: str, info: os.stat_result) -> None:
    """Remove the entry `name` of `directory` (`info`, not followed), a whole tree for a directory."""
    if not stat.S_ISDIR(info.st_mode):
        writable(directory, lambda: os.unlink(name, dir_fd=directory))
        return
    inner = enter(directory, name, make=False)
    if inner >= 0:
        try:
            os.fchmod(inner, 0o755)
            with os.scandir(inner) as listing:  # listed and closed first: one descriptor a level
                entries = [(entry.name, entry.stat(follow_symlinks=False)) for entry in listing]
            for entry_name, entry_info in entries:
                remove(inner, entry_name, entry_info)
        finally:
            os.close(inner)
    writable(directory, lambda: os.rmdir(name, dir_fd=directory))


def memory_file(name: str) -> int:
    """A file in memory, not inherited (only the descriptor dup'ed onto 1 or 2 is)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name)
    handle = tempfile.TemporaryFile()
    fd = os.dup(handle.fileno())
    handle.close()
    return fd


Streams = tuple[int, int, io.TextIOWrapper, io.TextIOWrapper]


def new_streams() -> Streams:
    """A cell's stdout and stderr: a memory file each, and `sys.stdout`/`sys.stderr` writing to fds 1, 2."""
    out, err = memory_file("stdout"), memory_file("stderr")
    return (
        out,
        err,
        io.TextIOWrapper(open(1, "wb", closefd=False), encoding="utf-8", line_buffering=True),
        io.TextIOWrapper(open(2, "wb", closefd=False), encoding="utf-8", line_buffering=True),
    )


def captured(fd: int, limit: int) -> tuple[str, int]:
    size = os.fstat(fd).st_size
    return base64.b64encode(os.pread(fd, limit, 0)).decode("ascii"), size


def cell_traceback(error: BaseException, filename: str) -> str:
    """The traceback from the cell's own frames on (the driver's are not the model's business), its
    middle cut past TRACEBACK_CHARS (a long message or a deep recursion)."""
    try:
        if isinstance(error, SyntaxError):
            text = "".join(traceback.format_exception_only(type(error), error))
        else:
            tb = error.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != filename:
                tb = tb.tb_next
            text = "".join(traceback.format_exception(type(error), error, tb or error.__traceback__))
    except BaseException as failure:  # an exception whose __str__ raises, or that is too deep to format
        text = f"{type(error).__name__} (its traceback could not be formatted: {type(failure).__name__})\n"
    if len(text) > TRACEBACK_CHARS:
        half = TRACEBACK_CHARS // 2
        cut = f"[traceback truncated: {len(text) - 2 * half} of {len(text)} characters cut]"
        text = f"{text[:half]}\n{cut}\n{text[-half:]}"
    return text


def execute(code: str, namespace: dict[str, Any], filename: str, deadline: float = 0.0) -> str | None:
    """Run the cell; the repr of its last expression's value (None if it ends otherwise or in None),
    given up at `deadline` (time.monotonic; 0: never), before the server stops the call and the state."""
    tree = ast.parse(code, filename, "exec")
    last = None
    final = tree.body[-1] if tree.body else None
    if isinstance(final, ast.Expr):
        tree.body.pop()
        last = ast.Expression(final.value)
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    importlib.invalidate_caches()  # files other tools wrote since are importable
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    value = eval(compile(last, filename, "eval"), namespace)
    if value is None:
        return None
    namespace["_"] = value
    try:
        text, whole = within(deadline, lambda: shown(value, REPR_CHARS, set()))
    except ReprTimeout:
        return "[not shown: the value's repr did not finish within the call's time; the value is in `_`]"
    if len(text) > REPR_CHARS or not whole:
        cut = f"{len(text) - REPR_CHARS} of {len(text)} characters cut" if whole else "shown in part"
        text = text[:REPR_CHARS] + f"\n[value truncated: {cut}]"
    return text


REPR_MARGIN_SECONDS = 0.5  # of the call's time, left for the answer once showing a value is given up


class ReprTimeout(BaseException):  # not an Exception: a repr that catches those does not swallow it
    """Showing a cell's value took past its deadline."""


def within(deadline: float, step: Callable[[], T]) -> T:
    """`step()`, interrupted by ReprTimeout at `deadline` (a cell's own timer and SIGALRM handler are put
    back afterwards)."""
    if not deadline:
        return step()

    def expired(signum: int, frame: Any) -> None:
        raise ReprTimeout

    begun = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expired)
    armed = signal.setitimer(signal.ITIMER_REAL, max(deadline - begun, 0.05))
    try:
        return step()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if armed[0] > 0:  # the cell's own timer, less the time spent here
            signal.setitimer(signal.ITIMER_REAL, max(armed[0] - (time.monotonic() - begun), 1e-6), armed[1])


BRACKETS: dict[type, tuple[str, str]] = {
    list: ("[", "]"),
    tuple: ("(", ")"),
    set: ("{", "}"),
    frozenset: ("frozenset({", "})"),
}


def shown(value: Any, budget: int, open_: set[int]) -> tuple[str, bool]:
    """`repr(value)`, and whether it is whole: of a string, bytes or a builtin container (not a subclass)
    only about the first `budget` characters are made, so showing a value of hundreds of megabytes costs
    its first few items, never a copy of its whole repr (which could outgrow the interpreter's memory and
    lose its state). `open_`: the ids of the containers being shown, as repr marks a container in itself."""
    kind = type(value)
    if kind in (str, bytes, bytearray):
        if len(value) <= budget:
            return repr(value), True
        return repr(value[:budget]), False
    if kind not in BRACKETS and kind is not dict:
        return repr(value), True
    if not value:
        return repr(value), True
    if id(value) in open_:
        return ("{...}" if kind is dict else "[...]" if kind is list else repr(value)), True
    open_.add(id(value))
    try:
        first, last = ("{", "}") if kind is dict else BRACKETS[kind]
        parts: list[str] = []
        used = len(first) + len(last)
        whole = True
        for item in value.items() if kind is dict else value:
            if used > budget:
                whole = False
                break
            if kind is dict:
                key, key_whole = shown(item[0], budget - used, open_)
                shown_value, value_whole = shown(item[1], budget - used - len(key), open_)
                part, part_whole = f"{key}: {shown_value}", key_whole and value_whole
            else:
                part, part_whole = shown(item, budget - used, open_)
            parts.append(part)
            used += len(part) + 2
            whole = whole and part_whole
        if not whole:
            parts.append("...")
        if kind is tuple and len(value) == 1 and whole:
            return f"({parts[0]},)", True
        return first + ", ".join(parts) + last, whole
    finally:
        open_.discard(id(value))


Entry = tuple[str, bytes, int]  # kind ("f" file, "l" link, "d" directory), content or target, mode


def snapshot(root: str) -> dict[str, Entry]:
    """Every file, link and directory under `root` (special files are left out), with contents and
    modes (`"."` is the root's mode). What the driver may not read or enter (mode 000, say) is opened
    to it as the walk goes; `set_modes` gives the modes back."""
    entries: dict[str, Entry] = {}
    try:
        mode = stat.S_IMODE(os.lstat(root).st_mode)
        entries["."] = ("d", b"", mode)
        if mode & 0o700 != 0o700:
            os.chmod(root, mode | 0o700)
    except OSError:
        pass
    for directory, dirnames, filenames in os.walk(root):  # top-down: a directory is opened before its turn
        for name in dirnames + filenames:
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, root)
            try:
                info = os.lstat(path)
                mode = stat.S_IMODE(info.st_mode)
                if stat.S_ISLNK(info.st_mode):
                    entries[relative] = ("l", os.fsencode(os.readlink(path)), 0)
                elif stat.S_ISDIR(info.st_mode):
                    entries[relative] = ("d", b"", mode)
                    if mode & 0o700 != 0o700:
                        os.chmod(path, mode | 0o700)
                elif stat.S_ISREG(info.st_mode):
                    if not mode & 0o400:
                        os.chmod(path, mode | 0o400)
                    with open(path, "rb") as handle:
                        entries[relative] = ("f", handle.read(), mode)
            except OSError:
                continue
    return entries


def _depth(relative: str) -> int:
    return -1 if relative == "." else relative.count(os.sep)


def set_modes(root: str, entries: dict[str, Entry]) -> None:
    """The modes of `entries`, deepest first (a parent's search right is needed to reach a child)."""
    for relative in sorted(entries, key=_depth, reverse=True):
        kind, _, mode = entries[relative]
        if kind != "l":
            try:
                os.chmod(os.path.join(root, relative), mode)
            except OSError:
                pass


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        for inner in os.listdir(path):
            _remove(os.path.join(path, inner))
        os.rmdir(path)
    else:
        os.unlink(path)


def restore(root: str, before: dict[str, Entry]) -> bool:
    """Put `root` back as `before` had it (contents, entries, modes); True when it holds exactly that."""
    now = snapshot(root)  # opens what a check closed to the driver, too
    for relative in sorted(now, key=_depth, reverse=True):
        was = before.get(relative)
        if relative == "." or now[relative] == was or (was is not None and now[relative][0] == was[0] == "d"):
            continue
        try:
            _remove(os.path.join(root, relative))
        except OSError:
            pass
    for relative in sorted(before, key=_depth):
        kind, content, _ = before[relative]
        path = os.path.join(root, relative)
        try:
            if kind == "d":
                os.makedirs(path, exist_ok=True)
            elif kind == "l" and not os.path.lexists(path):
                os.symlink(os.fsdecode(content), path)
            elif kind == "f" and now.get(relative) != before[relative]:
                with open(path, "wb") as handle:
                    handle.write(content)
        except OSError:
            pass
    set_modes(root, before)
    after = snapshot(root)
    set_modes(root, before)
    return after == before


def _children(parent: int) -> set[int]:
    """The processes whose parent is `parent` (read from /proc)."""
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and int(fields[1]) == parent:
            found.add(int(name))
    return found


def add_prompt_helpers(job: dict[str, Any], namespace: dict[str, Any]) -> None:
    """The prompt's helpers the tests use (`poly`, say), where the cells defined no such name."""
    entry_point, prompt = job.get("entry_point"), job.get("prompt") or ""
    if prompt:
        helpers: dict[str, Any] = {"__name__": "__prompt__"}
        exec(compile(prompt, "<prompt>", "exec"), helpers)
        for name, value in helpers.items():
            if not name.startswith("__") and name != entry_point and name not in namespace:
                namespace[name] = value


def run_check(job: dict[str, Any], namespace: dict[str, Any]) -> None:
    """The check, in the fork: the test code in (a copy of) the cells' namespace, then `check(entry)`."""
    entry_point = job.get("entry_point")
    add_prompt_helpers(job, namespace)
    candidate = None
    if entry_point:
        if entry_point not in namespace:
            raise LookupError(f"the interpreter defines no {entry_point!r}")
        candidate = namespace[entry_point]
    exec(compile(job["test"], "<hidden tests>", "exec"), namespace)
    if entry_point:
        namespace["check"](candidate)


class Driver:
    def __init__(self, frames: int, requests: int, workspace: str, supervisor: types.ModuleType) -> None:
        self.frames = frames
        self.requests = requests
        self.workspace = workspace
        self.supervisor = supervisor
        self.cells = 0
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        self.namespace = main.__dict__
        self.null = os.open(os.devnull, os.O_RDWR)  # not inherited
        self.streams: Streams | None = None  # the next cell's, made while nobody waits
        self.spent: tuple[int, ...] = ()  # the last cell's memory files, let go after its answer

    def cell(self, request: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        not_placed = apply_files(self.workspace, request["files"])
        self.cells += 1
        filename = f"<cell {self.cells}>"
        out, err, stdout, stderr = self.streams or new_streams()
        self.streams = None
        answer: dict[str, Any] = {"id": request["id"], "value": None, "exception": None}
        if not_placed:
            answer["not_placed"] = not_placed[:MAX_NOT_PLACED]
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout, sys.stderr = stdout, stderr
        try:
            deadline = started + float(request.get("seconds") or 0) - REPR_MARGIN_SECONDS
            answer["value"] = execute(request["code"], self.namespace, filename, deadline)
        except BaseException as error:  # SystemExit too: a cell ends, the interpreter stays
            answer["exception"] = cell_traceback(error, filename)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
        limit = int(request["output_bytes"])
        answer["stdout"], answer["stdout_total"] = captured(out, limit)
        answer["stderr"], answer["stderr_total"] = captured(err, limit)
        self.spent = (out, err)
        answer["files"] = self.walk(int(request["max_files"]), int(request["max_bytes"]))
        return answer

    def between_cells(self) -> None:
        """Once a cell's answer is sent (nobody waits on this): fds 1 and 2 back on /dev/null, the cell's
        memory files let go, the next cell's streams made."""
        os.dup2(self.null, 1)
        os.dup2(self.null, 2)
        for fd in self.spent:
            os.close(fd)
        self.spent = ()
        if self.streams is None:
            self.streams = new_streams()

    def drop_streams(self) -> None:
        """No cell's memory file open in a fork that runs other code (a grade's check)."""
        if self.streams is not None:
            os.close(self.streams[0])
            os.close(self.streams[1])
            self.streams = None

    def walk(self, max_files: int, max_bytes: int) -> str:
        report = io.BytesIO()
        report.write(b"S")
        walk = self.supervisor.Walk(report, self.workspace, max_files, max_bytes)
        walk.run()
        if walk.truncated:
            report.write(b"T")
        report.write(b"Z")
        return base64.b64encode(report.getvalue()).decode("ascii")

    def check(self, request: dict[str, Any]) -> dict[str, Any]:
        """A grade's check in a fork of this interpreter; the workspace is put back afterwards."""
        self.drop_streams()
        before = snapshot(self.workspace)
        not_placed = apply_files(self.workspace, request.get("files") or {})  # the rollout's final files
        existing = _children(os.getpid())
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # the check's orphans come back to the driver
        verdict_r, verdict_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the fork: no way to the server but the verdict pipe
            verdict: dict[str, Any] = {"passed": False, "error": None}
            try:
                os.close(verdict_r)
                os.close(self.frames)
                os.close(self.requests)
                os.setpgid(0, 0)
                run_check(request["check"], self.namespace)
                verdict["passed"] = True
            except BaseException as error:  # SystemExit too: the check did not finish
                verdict["error"] = "".join(traceback.format_exception_only(type(error), error))[
                    :CHECK_ERROR_CHARS
                ]
            try:
                send(verdict_w, verdict)
            finally:
                os._exit(0)
        os.close(verdict_w)
        answer: dict[str, Any] = {"id": request["id"], "passed": False, "error": None, "timed_out": False}
        if not_placed:
            answer["not_placed"] = not_placed[:CHECK_NOT_PLACED]
        try:
            ready, _, _ = select.select([verdict_r], [], [], float(request["seconds"]))
            if not ready:
                answer["timed_out"] = True
                answer["error"] = f"the check did not finish within {float(request['seconds']):g} seconds"
            else:
                header = read_exactly(verdict_r, 4)
                body = read_exactly(verdict_r, struct.unpack(">I", header)[0]) if header else None
                verdict = json.loads(body) if body else {}
                if not isinstance(verdict, dict):
                    verdict = {}
                answer["passed"] = verdict.get("passed") is True
                why = verdict.get("error")
                answer["error"] = str(why)[:CHECK_ERROR_CHARS] if why else None
                if body is None:
                    answer["error"] = "the check's process ended without a verdict"
        except (OSError, ValueError, struct.error):
            answer["passed"] = False
            answer["error"] = "the check's process answered garbage"
        finally:
            os.close(verdict_r)
            self.stop_check(pid, existing)
            libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        answer["restored"] = restore(self.workspace, before)  # its modes, opened by the snapshot, too
        return answer

    def serve_calls(self, request: dict[str, Any]) -> dict[str, Any]:
        """A grade's calls of the entry point, in a fork of this interpreter (the cells' namespace, a
        copy): each `{"line"}` frame the server relays from the grade's judge is one call, answered as
        harness_runner answers it (plain values only); `{"end"}` ends the fork. The workspace is put back
        afterwards, as after a check. Nothing here is trusted: the judge, in a process no cell ever ran
        in, decides."""
        self.drop_streams()
        job = request["serve"]
        values = load_module("harness_runner", str(job["runner"]))
        before = snapshot(self.workspace)
        not_placed = apply_files(self.workspace, request.get("files") or {})  # the rollout's final files
        existing = _children(os.getpid())
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        # The fork answers on a pipe of its own, which this driver relays frame by frame: a fork killed at
        # the time limit halfway through an answer leaves no part of it on the frame pipe.
        replies_in, replies = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(replies_in)
                os.close(self.frames)
                os.setpgid(0, 0)
                self.answer_calls(request["id"], job, values, replies, int(request["max_reply_chars"]))
            finally:
                os._exit(0)
        os.close(replies)
        answer: dict[str, Any] = {"id": request["id"], "timed_out": False}
        if not_placed:
            answer["not_placed"] = not_placed[:CHECK_NOT_PLACED]
        ended = os.pidfd_open(pid)  # readable once the fork has ended (whatever it left running)
        try:
            answer["timed_out"] = not self.relay(
                replies_in, ended, float(request["seconds"]), int(request["max_frame_bytes"])
            )
        finally:
            os.close(ended)
            os.close(replies_in)
            self.stop_check(pid, existing)
            libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        answer["restored"] = restore(self.workspace, before)
        return answer

    def relay(self, replies: int, ended: int, seconds: float, max_frame: int) -> bool:
        """The fork's whole frames, as they come, onto the frame pipe, until it ends (True) or its time is
        up (False); what it leaves unfinished is dropped. A frame over the ceiling ends the relay (the
        fork is then stopped as at its time limit)."""
        deadline = time.monotonic() + seconds
        pending = bytearray()
        os.set_blocking(replies, False)
        watched = [ended, replies]
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            ready, _, _ = select.select(watched, [], [], remaining)
            if replies in ready:
                try:
                    chunk = os.read(replies, 1 << 16)
                except BlockingIOError:
                    chunk = None
                if chunk == b"":
                    watched = [ended]  # closed: the fork and whatever it left hold it no more
                elif chunk:
                    pending += chunk
                    if not self.forward(pending, max_frame):
                        return False
                continue
            if ended in ready:
                # What the fork wrote before it ended, whole frames only (a process it left may still hold
                # the pipe open: read until it is empty, not until its end).
                with contextlib.suppress(BlockingIOError):
                    while time.monotonic() < deadline and (chunk := os.read(replies, 1 << 16)):
                        pending += chunk
                        if not self.forward(pending, max_frame):
                            break
                return True

    def forward(self, pending: bytearray, max_frame: int) -> bool:
        """Send the whole frames at the start of `pending` on the frame pipe (taking them off it); False
        when the next frame says it is larger than any frame may be."""
        while len(pending) >= 4:
            (size,) = struct.unpack(">I", pending[:4])
            if size > max_frame:
                return False
            if len(pending) < 4 + size:
                return True
            view = memoryview(pending)[: 4 + size]
            while view:
                view = view[os.write(self.frames, view) :]
            view.release()
            del pending[: 4 + size]
        return True

    def answer_calls(
        self, request_id: str, job: dict[str, Any], values: types.ModuleType, replies: int, max_reply: int
    ) -> None:
        """In the fork: the entry point's calls, until `{"end"}` or the end of the requests; each answer a
        frame on `replies`, which the driver relays, of at most `max_reply` characters of JSON (ASCII: the
        frame escapes it again, at most doubling it, well under the frame ceiling)."""
        entry_point = str(job.get("entry_point") or "")
        failure = ""
        try:
            add_prompt_helpers(job, self.namespace)
            candidate = self.namespace[entry_point]
        except KeyError:
            failure = f"the interpreter defines no {entry_point!r}"
        except BaseException as error:
            failure = f"the prompt's helpers failed: {type(error).__name__}: {error}"[:CHECK_ERROR_CHARS]
        while True:
            message = read_frame(self.requests)
            if message is None or "line" not in message:
                return
            reply: dict[str, Any]
            if failure:
                reply = {"error": failure}
            else:
                try:
                    call = json.loads(message["line"])
                    value = candidate(*values.decode(call["args"]), **values.decode(call["kwargs"]))
                    reply = {"value": values.encode(value)}
                except BaseException as error:  # an exit inside the function is a failed call
                    text = "".join(traceback.format_exception_only(type(error), error)).strip()
                    reply = {"error": text[:CHECK_ERROR_CHARS]}
            try:
                line = json.dumps(reply)
            except (TypeError, ValueError):
                line = '{"error": "the value could not be sent"}'
            if len(line) > max_reply:  # the server would not relay it
                line = json.dumps({"error": f"the value is too large to send ({len(line)} characters)"})
            send(replies, {"id": request_id, "line": line})

    def judge(self, request: dict[str, Any]) -> dict[str, Any]:
        """A grade's hidden tests, here in a driver no cell ever ran in, against a stand-in for the entry
        point whose calls the server relays to the rollout's interpreter (`serve_calls`): only plain
        values come back, decoded here, so nothing the rollout's code does there can pass a test for it.
        Answers `{"id", "passed", "error"}`."""
        job = request["judge"]
        harness = load_module("harness_main", str(job["main"]))
        request_id = request["id"]
        driver = self

        class Calls:  # the stand-in's way to the rollout's interpreter: a frame per call, through the server
            def __init__(self) -> None:
                self.pending = b""

            def write(self, data: bytes) -> int:
                self.pending += data
                return len(data)

            def flush(self) -> None:
                line, self.pending = self.pending.decode("utf-8").rstrip("\n"), b""
                send(driver.frames, {"id": request_id, "line": line})

            def readline(self, limit: int = -1) -> bytes:
                message = read_frame(driver.requests)
                line = message.get("line") if message is not None else None
                if not isinstance(line, str):
                    return b""  # the rollout's interpreter is gone: the call fails
                return line.encode("utf-8") + b"\n"

        calls = Calls()
        candidate = harness.Candidate(0, calls, calls)
        namespace: dict[str, Any] = {"__name__": "__hidden_tests__"}
        answer: dict[str, Any] = {"id": request_id, "passed": False, "error": None}
        try:
            exec(compile(job.get("prompt") or "", "<prompt>", "exec"), namespace)
            namespace[job["entry_point"]] = candidate
            exec(compile(job["test"], "<hidden tests>", "exec"), namespace)
            namespace["check"](candidate)
            answer["passed"] = True
        except BaseException as error:  # SystemExit too: the tests did not finish
            answer["error"] = "".join(traceback.format_exception_only(type(error), error))[:CHECK_ERROR_CHARS]
        return answer

    def stop_check(self, pid: int, existing: set[int]) -> None:
        """Kill the check's fork and every process it left, and reap them."""
        for _ in range(STOP_ROUNDS):
            for target in (pid,):
                try:
                    os.killpg(target, signal.SIGKILL)
                except OSError:
                    pass
            left = _children(os.getpid()) - existing
            for child in left:
                try:
                    os.kill(child, signal.SIGKILL)
                except OSError:
                    pass
            for child in left | {pid}:
                try:
                    os.waitpid(child, 0)
                except ChildProcessError:
                    pass
            if not left:
                return

    def serve(self) -> None:
        self.between_cells()
        send(self.frames, {"ready": True})
        while True:
            header = read_exactly(self.requests, 4)
            if header is None:
                return
            body = read_exactly(self.requests, struct.unpack(">I", header)[0])
            if body is None:
                return
            request = json.loads(body)
            if "code" in request:
                answer = self.cell(request)
            elif "check" in request:
                answer = self.check(request)
            elif "serve" in request:
                answer = self.serve_calls(request)
            elif "judge" in request:
                answer = self.judge(request)
            else:
                continue  # a relayed call or end that came after its grade's calls had ended
            send(self.frames, answer)
            self.between_cells()


def main() -> int:
    frame_fd, workspace, supervisor_source = sys.argv[1:4]
    frames = os.dup(int(frame_fd))  # dup'ed descriptors are not inherited by what a cell starts
    requests = os.dup(0)
    os.close(int(frame_fd))
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # output past the file-size limit fails, never kills
    os.chdir(workspace)
    sys.path.insert(0, workspace)
    Driver(frames, requests, workspace, load_module("harness_supervisor", supervisor_source)).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
