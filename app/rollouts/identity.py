"""What names a rollout and its calls on the wire, for the server: the rules live in `sparring.wire`.

Both request paths (tool calls and grades) import these, so a trace id, a run label or an item key is
stored the same way whichever path saw it first, and the client computes the same keys.
"""

from __future__ import annotations

from sparring.wire import (
    CALL_ID_MAX,
    ITEM_ID_FIELDS,
    ITEM_KEY_MAX,
    JSON_DEPTH_MAX,
    RUN_HEADER,
    RUN_MAX,
    TRACE_ID_MAX,
    call_key,
    fit,
    item_key,
    nested_deeper_than,
    trace_key,
)

__all__ = [
    "CALL_ID_MAX",
    "ITEM_ID_FIELDS",
    "ITEM_KEY_MAX",
    "JSON_DEPTH_MAX",
    "RUN_HEADER",
    "RUN_MAX",
    "TRACE_ID_MAX",
    "call_key",
    "fit",
    "item_key",
    "nested_deeper_than",
    "trace_key",
]
