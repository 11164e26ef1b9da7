"""The grading harness, run in the sandbox (never imported by the server): `python -I -c <this> WORKSPACE`.

It reads the job (the task's prompt and hidden tests, the runner's source, a per-run token) from stdin,
makes itself unreadable to other processes, and starts the solution in a separate process (the runner).
The hidden tests run here, against a proxy that sends each call's arguments to the runner and accepts
only plain values back (None, bool, int, float, str and lists, tuples, sets and dicts of them), decoded
by this process, never objects the solution built. Only when `check` returns does it print the token,
which the solution never sees: exiting early, patching builtins or the harness, or claiming equality
cannot print it.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from typing import Any

MAX_REPLY_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 200
PR_SET_DUMPABLE = 4


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

    def __init__(self, runner: subprocess.Popen[bytes], to_runner: Any, from_runner: Any) -> None:
        self.runner = runner
        self.to_runner = to_runner
        self.from_runner = from_runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = {"args": encode(list(args)), "kwargs": encode(kwargs)}
        try:
            self.to_runner.write(json.dumps(request).encode() + b"\n")
            self.to_runner.flush()
        except OSError as exc:
            raise CandidateFailed(f"the solution's process is gone: {exc}") from None
        line = self.from_runner.readline(MAX_REPLY_BYTES)
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


def main() -> int:
    # Not dumpable: the runner (same uid) cannot read this process's memory, fds or environment.
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    job = json.loads(sys.stdin.buffer.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # stdin is spent; keep fd 0 taken
    workspace = sys.argv[1]
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    runner = subprocess.Popen(
        [
            sys.executable,
            *("-I", "-B", "-X", "utf8", "-c", job["runner"]),
            *(str(request_r), str(reply_w), workspace, job["entry_point"]),
        ],
        stdin=subprocess.DEVNULL,
        stdout=2,
        stderr=2,
        pass_fds=(request_r, reply_w),
        cwd=workspace,
    )
    os.close(request_r)
    os.close(reply_w)
    candidate = Candidate(runner, os.fdopen(request_w, "wb"), os.fdopen(reply_r, "rb"))
    namespace: dict[str, Any] = {"__name__": "__hidden_tests__"}
    # The prompt's own code (helpers such as `poly` or `encode_cyclic`), then the hidden tests: both come
    # from the data, never from the workspace.
    exec(compile(job["prompt"], "<prompt>", "exec"), namespace)
    namespace[job["entry_point"]] = candidate
    exec(compile(job["test"], "<hidden tests>", "exec"), namespace)
    namespace["check"](candidate)
    sys.stdout.write(job["token"] + "\n")
    sys.stdout.flush()
    runner.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
