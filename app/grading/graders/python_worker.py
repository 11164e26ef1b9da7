"""The worker process of python graders: runs `grade(sample, item)` for requests read as JSON lines.

Started by app.grading.graders.python_pool as `python -I python_worker.py <memory_mb>`, it uses only the
standard library (it must start fast and import nothing of the server). Protocol, one JSON object per line:
it writes `{"ready": true}` once its limits are set, then answers each request
`{"source", "sample", "item"[, "rollout"]}` with `{"score": float}` or `{"error": "..."}`. The grader's
own prints go to stderr and its reads of stdin find nothing, so they cannot corrupt the protocol.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import sys
import traceback
from collections import OrderedDict
from typing import Any, BinaryIO

MAX_ERROR = 2000
MAX_CACHED_SOURCES = 32


def _send(out: BinaryIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


def _describe(exc: BaseException) -> str:
    """The exception and the grader line that raised it (not the worker's own frames)."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<grader>"]
    if frames:
        text += f" (grader line {frames[-1].lineno})"
    return text[:MAX_ERROR]


class Graders:
    """Compiled grader sources, by hash of their text."""

    def __init__(self) -> None:
        self._functions: OrderedDict[str, Any] = OrderedDict()

    def get(self, source: str) -> Any:
        key = hashlib.sha256(source.encode()).hexdigest()
        function = self._functions.get(key)
        if function is None:
            namespace: dict[str, Any] = {"__name__": "__grader__", "__builtins__": __builtins__}
            exec(compile(source, "<grader>", "exec"), namespace)  # the operator's own grader code
            function = namespace.get("grade")
            if not callable(function):
                raise TypeError("the source does not define a function grade(sample, item)")
            self._functions[key] = function
            while len(self._functions) > MAX_CACHED_SOURCES:
                self._functions.popitem(last=False)
        else:
            self._functions.move_to_end(key)
        return function


def run(request: dict[str, Any], graders: Graders) -> dict[str, Any]:
    try:
        function = graders.get(request["source"])
        args = [request.get("sample") or {}, request.get("item") or {}]
        if "rollout" in request:
            args.append(request["rollout"])
        value = function(*args)
    except BaseException as exc:  # anything the grader does, including sys.exit and MemoryError
        return {"error": _describe(exc)}
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, int | float):
        return {"error": f"grade() returned {type(value).__name__} {str(value)[:100]!r}, not a number"}
    try:
        number = float(value)
    except OverflowError:
        return {"error": "grade() returned an integer too large for a float"}
    if not math.isfinite(number):
        return {"error": f"grade() returned {number!r}, not a finite number"}
    return {"score": number}


def main() -> None:
    memory_mb = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # even C-level writes to stdout land on stderr
    sys.stdin = open(os.devnull, encoding="utf-8")
    sys.stdout = sys.stderr
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _send(answers, {"ready": True})
    graders = Graders()
    for line in requests:
        try:
            request = json.loads(line)
        except ValueError as exc:
            _send(answers, {"error": f"bad request: {exc}"})
            continue
        _send(answers, run(request, graders))


if __name__ == "__main__":
    main()
