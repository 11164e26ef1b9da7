"""The grading harness, run in the sandbox (never imported by the server): `python -I -c <this> WORKSPACE`.

It makes itself unreadable to other processes, forks the solution's process (the runner) before it reads
anything, then reads the job from stdin (the task's prompt and hidden tests, the runner's source, a
per-run token) and sends the runner only its source and the entry point.
The hidden tests run here, against a proxy that sends each call's arguments to the runner and accepts
only plain values back (None, bool, int, float, str and lists, tuples, sets and dicts of them), decoded
by this process, never objects the solution built. Only when `check` returns does it print the token,
which the solution never sees: exiting early, patching builtins or the harness, or claiming equality
cannot print it.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import json
import os
import resource
import signal
import struct
import sys
import time
import traceback
import types
from typing import Any

MAX_REPLY_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 200
PR_SET_DUMPABLE = 4
MAX_FD = 1 << 16  # above any descriptor a run may hold (its RLIMIT_NOFILE is lower)


class CandidateFailed(Exception):
    """The solution's call did not give a plain value back (it raised, exited or answered garbage)."""


def encode(value: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise CandidateFailed("value nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(item, depth + 1) for item in value]
    if kind in (tuple, set, frozenset):
        return {"t": kind.__name__, "v": [encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"t": "dict", "v": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise CandidateFailed(f"cannot send a {kind.__name__} to the solution")


def decode(value: Any, depth: int = 0) -> Any:
    """A plain value from the runner's JSON: anything else is refused."""
    if depth > MAX_DEPTH:
        raise CandidateFailed("the solution returned a value nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [decode(item, depth + 1) for item in value]
    if kind is dict and set(value) == {"t", "v"} and type(value["v"]) is list:
        items = [decode(item, depth + 1) for item in value["v"]]
        tag = value["t"]
        if tag == "tuple":
            return tuple(items)
        if tag == "set":
            return set(items)
        if tag == "frozenset":
            return frozenset(items)
        if tag == "dict" and all(type(pair) is list and len(pair) == 2 for pair in items):
            return {key: item for key, item in items}
    raise CandidateFailed("the solution returned something other than a plain value")


class Candidate:
    """Stands for the solution's entry point: each call runs in the runner process."""

    def __init__(self, runner: int, to_runner: Any, from_runner: Any) -> None:
        self.runner = runner
        self.to_runner = to_runner
        self.from_runner = from_runner
        self.ended = False  # the runner's pipes ended: it exited or was killed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = {"args": encode(list(args)), "kwargs": encode(kwargs)}
        try:
            self.to_runner.write(json.dumps(request).encode() + b"\n")
            self.to_runner.flush()
        except OSError as exc:
            self.ended = True
            raise CandidateFailed(f"the solution's process is gone: {exc}") from None
        line = self.from_runner.readline(MAX_REPLY_BYTES)
        if not line:
            self.ended = True
        if not line.endswith(b"\n"):
            raise CandidateFailed("the solution's process ended (it exited, crashed or was killed)")
        try:
            reply = json.loads(line)
        except ValueError:
            raise CandidateFailed("the solution's process answered garbage") from None
        if type(reply) is not dict:
            raise CandidateFailed("the solution's process answered garbage")
        if "error" in reply:
            raise CandidateFailed(str(reply["error"])[:2000])
        return decode(reply.get("value"))


def start_runner(workspace: str) -> tuple[int, int, int]:
    """Fork the runner before the job is read, so its memory never held the tests or the token: it waits
    for its source and entry point, then runs as `python -I -B -X utf8 -c <runner> REQ REPLY WORKSPACE
    ENTRY` would (a fork of this interpreter, not a second start). Answers its pid and this side's pipes."""
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)  # first: the job arrives on this process's stdin, never for the runner
            os.close(null)
            os.dup2(2, 1)
            # Only the two pipes to this harness beside 0-2, as a runner started with them passed would
            # hold: a fork keeps every descriptor, close-on-exec or not (on the warm path, the pipe on
            # which this process tells its init its exit status: the solution could end its run with it).
            low, high = sorted((request_r, reply_w))
            os.closerange(3, low)
            os.closerange(low + 1, high)
            os.closerange(high + 1, MAX_FD)
            for fd in (request_r, reply_w):
                os.set_inheritable(fd, True)
            ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # as an exec'd runner would be
            os._exit(run_runner(request_r, reply_w, workspace))
        except BaseException:
            os._exit(70)
    os.close(request_r)
    os.close(reply_w)
    return pid, request_w, reply_r


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("the harness ended before sending the runner")
        data += chunk
    return data


def _compiled(source: str) -> types.CodeType:
    """The runner's code: the warm parent's copy compiled in advance when it has one (see
    `harness_zygote.py`), else compiled here as `python -c` would."""
    precompiled = getattr(sys.modules.get("sparring_precompiled"), "code", None)
    code = precompiled.get(source) if isinstance(precompiled, dict) else None
    return code if isinstance(code, types.CodeType) else compile(source, "<string>", "exec")


def run_runner(request_r: int, reply_w: int, workspace: str) -> int:
    """In the forked runner: its source and entry point (a length-prefixed JSON frame), then its code in
    a fresh `__main__`; its exit status."""
    (size,) = struct.unpack(">I", _read_exactly(request_r, 4))
    setup = json.loads(_read_exactly(request_r, size))
    os.chdir(workspace)
    sys.argv = ["-c", str(request_r), str(reply_w), workspace, setup["entry_point"]]
    main_module = types.ModuleType("__main__")
    main_module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main_module
    status = 0
    try:
        exec(_compiled(setup["runner"]), main_module.__dict__)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    return status


def over_cpu_limit(runner: int) -> bool:
    """Whether the runner, whose pipes ended, was ended by its CPU-time limit (SIGXCPU at the soft limit,
    SIGKILL at the hard one, after the whole allowance): waited for a moment, not reaped."""
    limit = resource.getrlimit(resource.RLIMIT_CPU)[0]
    if limit == resource.RLIM_INFINITY:
        return False
    for _ in range(200):
        try:
            ended = os.waitid(os.P_PID, runner, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        if ended is not None:
            break
        time.sleep(0.001)
    else:
        return False
    if ended.si_code not in (os.CLD_KILLED, os.CLD_DUMPED) or ended.si_status not in (
        signal.SIGXCPU,
        signal.SIGKILL,
    ):
        return False
    try:
        with open(f"/proc/{runner}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") >= limit - 0.1
    except (OSError, IndexError, ValueError):
        return False


def main() -> int:
    # Not dumpable: the runner (same uid) cannot read this process's memory, fds or environment.
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    workspace = sys.argv[1]
    runner, request_w, reply_r = start_runner(workspace)
    job = json.loads(sys.stdin.buffer.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # stdin is spent; keep fd 0 taken
    to_runner = os.fdopen(request_w, "wb")
    setup = json.dumps({"runner": job["runner"], "entry_point": job["entry_point"]}).encode()
    try:
        to_runner.write(struct.pack(">I", len(setup)) + setup)
        to_runner.flush()
    except OSError:
        pass  # the runner is gone: every call fails, as it would
    candidate = Candidate(runner, to_runner, os.fdopen(reply_r, "rb"))
    namespace: dict[str, Any] = {"__name__": "__hidden_tests__"}
    # The prompt's own code (helpers such as `poly` or `encode_cyclic`), then the hidden tests: both come
    # from the data, never from the workspace.
    exec(compile(job["prompt"], "<prompt>", "exec"), namespace)
    namespace[job["entry_point"]] = candidate
    exec(compile(job["test"], "<hidden tests>", "exec"), namespace)
    try:
        namespace["check"](candidate)
    except BaseException:
        if candidate.ended and over_cpu_limit(runner):
            # The solution ran out of CPU time, which the server counts as running out of time: said on
            # this process's stdout, which the solution never holds, with the run's token.
            sys.stdout.write(job["token"] + " cpu-time-limit\n")
            sys.stdout.flush()
        raise
    sys.stdout.write(job["token"] + "\n")
    sys.stdout.flush()
    with contextlib.suppress(OSError):
        os.kill(runner, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
