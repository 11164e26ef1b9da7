"""The solution's side of the grading harness, run inside the sandbox (never imported by the server).

`python -I -c <this> REQUEST_FD REPLY_FD WORKSPACE ENTRY_POINT`: imports `solution` from the workspace and
answers each call sent by the harness with the plain value the entry point returned, or an error. What it
answers is checked again by the harness, which trusts nothing from this process.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from typing import Any

MAX_DEPTH = 200


class NotPlain(Exception):
    pass


def encode(value: Any, depth: int = 0) -> Any:
    """Only exact builtin types: a subclass (say of int or str with its own `__eq__`) is refused."""
    if depth > MAX_DEPTH:
        raise NotPlain("value nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(item, depth + 1) for item in value]
    if kind in (tuple, set, frozenset):
        return {"t": kind.__name__, "v": [encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"t": "dict", "v": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise NotPlain(f"returned a {kind.__name__}, not a plain value (None, bool, int, float, str, list, ...)")


def decode(value: Any) -> Any:
    if type(value) is list:
        return [decode(item) for item in value]
    if type(value) is dict:
        items = [decode(item) for item in value["v"]]
        tag = value["t"]
        if tag == "dict":
            return {key: item for key, item in items}
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    return value


def main() -> None:
    request_fd, reply_fd, workspace, entry_point = sys.argv[1:5]
    requests = os.fdopen(int(request_fd), "rb")
    replies = os.fdopen(int(reply_fd), "wb")
    dumps, loads = json.dumps, json.loads
    sys.path.insert(0, workspace)
    function: Any = None
    failure = ""
    try:
        function = getattr(importlib.import_module("solution"), entry_point)
    except BaseException as exc:  # SystemExit at import time included
        failure = f"importing solution.py failed: {type(exc).__name__}: {exc}"
    for line in requests:
        if failure:
            reply: dict[str, Any] = {"error": failure}
        else:
            try:
                request = loads(line)
                value = function(*decode(request["args"]), **decode(request["kwargs"]))
                reply = {"value": encode(value)}
            except BaseException as exc:  # an exit inside the function is a failed call, not a pass
                reply = {"error": "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]}
        try:
            replies.write(dumps(reply).encode() + b"\n")
        except (TypeError, ValueError):
            replies.write(b'{"error": "the value could not be sent"}\n')
        replies.flush()


if __name__ == "__main__":
    main()
