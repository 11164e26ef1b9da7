"""The persistent interpreter's driver, inside the sandbox (never imported by the server).

`python -I -S -B -c <this> FRAME_FD WORKSPACE SUPERVISOR_SOURCE`

Runs the cells of one rollout in one namespace, like a notebook kernel. Requests arrive on stdin, answers
leave on FRAME_FD, a pipe of its own: each frame is a u32 big-endian length, then that many bytes of
UTF-8 JSON. The driver moves both pipes to private descriptors (not inherited by anything a cell starts)
and points fds 0, 1 and 2 at /dev/null; during a cell, fds 1 and 2 are memory files whose first bytes
(and size) the answer carries, so whatever a cell prints (from Python, C or a child process) is output,
never a frame. A cell can still write to the frame pipe on purpose; the server trusts nothing in a
frame (capped, checked, a malformed one stops the interpreter, one of another request's id is skipped),
so the worst it forges is its own answer.

Request: `{"id", "code", "files": {path: text or null}, "output_bytes", "max_files", "max_bytes"}`;
`files` are the rollout's workspace changes to apply first (null: delete). The driver first answers
`{"ready": true}`; each cell answers `{"id"` (the request's), `"stdout", "stderr"` (base64 of the
first bytes), `"stdout_total", "stderr_total", "value"` (repr of a last expression, or null),
`"exception"` (a traceback, or null), `"files"` (base64 of the supervisor's report frames: the
workspace after the cell)`}`.
"""

from __future__ import annotations

import ast
import base64
import builtins
import importlib
import io
import json
import linecache
import os
import signal
import struct
import sys
import tempfile
import traceback
import types
from typing import Any

REPR_CHARS = 16 * 1024


def load_supervisor(source: str) -> types.ModuleType:
    """The run supervisor's code (its bounded workspace walk and frames), as a module."""
    module = types.ModuleType("harness_supervisor")
    exec(compile(source, "harness_supervisor.py", "exec"), module.__dict__)
    return module


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


def apply_files(workspace: str, files: dict[str, str | None]) -> None:
    """The rollout's changes to its files since the last cell (written by other tools, or deleted)."""
    for relative, content in files.items():
        path = os.path.join(workspace, relative)
        try:
            if content is None:
                os.unlink(path)
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(content)
        except OSError:
            pass  # a file and a directory of one name: the workspace keeps what it has


def memory_file(name: str) -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create(name, 0)
    handle = tempfile.TemporaryFile()
    fd = os.dup(handle.fileno())
    handle.close()
    return fd


def captured(fd: int, limit: int) -> tuple[str, int]:
    size = os.fstat(fd).st_size
    return base64.b64encode(os.pread(fd, limit, 0)).decode("ascii"), size


def cell_traceback(error: BaseException, filename: str) -> str:
    """The traceback from the cell's own frames on (the driver's are not the model's business)."""
    if isinstance(error, SyntaxError):
        return "".join(traceback.format_exception_only(type(error), error))
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb or error.__traceback__))


def execute(code: str, namespace: dict[str, Any], filename: str) -> str | None:
    """Run the cell; the repr of its last expression's value (None if it ends otherwise or in None)."""
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
    text = repr(value)
    if len(text) > REPR_CHARS:
        text = (
            text[:REPR_CHARS] + f"\n[value truncated: {len(text) - REPR_CHARS} of {len(text)} characters cut]"
        )
    return text


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

    def cell(self, request: dict[str, Any]) -> dict[str, Any]:
        apply_files(self.workspace, request["files"])
        self.cells += 1
        filename = f"<cell {self.cells}>"
        out, err = memory_file("stdout"), memory_file("stderr")
        answer: dict[str, Any] = {"id": request["id"], "value": None, "exception": None}
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), encoding="utf-8", line_buffering=True)
        sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), encoding="utf-8", line_buffering=True)
        try:
            answer["value"] = execute(request["code"], self.namespace, filename)
        except BaseException as error:  # SystemExit too: a cell ends, the interpreter stays
            answer["exception"] = cell_traceback(error, filename)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 1)
            os.dup2(null, 2)
            os.close(null)
        limit = int(request["output_bytes"])
        answer["stdout"], answer["stdout_total"] = captured(out, limit)
        answer["stderr"], answer["stderr_total"] = captured(err, limit)
        os.close(out)
        os.close(err)
        answer["files"] = self.walk(int(request["max_files"]), int(request["max_bytes"]))
        return answer

    def walk(self, max_files: int, max_bytes: int) -> str:
        report = io.BytesIO()
        report.write(b"S")
        walk = self.supervisor.Walk(report, self.workspace, max_files, max_bytes)
        walk.run()
        if walk.truncated:
            report.write(b"T")
        report.write(b"Z")
        return base64.b64encode(report.getvalue()).decode("ascii")

    def serve(self) -> None:
        send(self.frames, {"ready": True})
        while True:
            header = read_exactly(self.requests, 4)
            if header is None:
                return
            body = read_exactly(self.requests, struct.unpack(">I", header)[0])
            if body is None:
                return
            send(self.frames, self.cell(json.loads(body)))


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
    Driver(frames, requests, workspace, load_supervisor(supervisor_source)).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
