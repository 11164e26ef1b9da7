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
from collections import OrderedDict
from typing import Any

MAX_DEPTH = 200


class NotPlain(Exception):
    pass


def encode(value: Any, depth: int = 0) -> Any:
    """The plain value to send: builtin types as they are, and an instance of a subclass of one (a
    `Counter`, an `OrderedDict`, a named tuple, an `int` with its own `__eq__`) as its builtin value, read
    through the builtin type's own methods, so nothing the subclass defines decides what is sent."""
    if depth > MAX_DEPTH:
        raise NotPlain("value nested too deeply")
    kind = type(value)
    if value is None or kind is bool:
        return value
    if issubclass(kind, int):
        return int.__index__(value)
    if issubclass(kind, float):
        return float.__float__(value)
    if issubclass(kind, str):
        return str.__str__(value)
    if issubclass(kind, list):
        return [encode(item, depth + 1) for item in list.__iter__(value)]
    for base in (tuple, frozenset, set):
        if issubclass(kind, base):
            items = base.__iter__(value)
            return {"t": base.__name__, "v": [encode(item, depth + 1) for item in items]}
    if issubclass(kind, dict):
        # An OrderedDict's own order (which `move_to_end` changes), else the dict's.
        pairs = OrderedDict.items(value) if issubclass(kind, OrderedDict) else dict.items(value)
        return {"t": "dict", "v": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in pairs]}
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
