"""What names a rollout and its calls on the wire: column limits, `fit`, the run header, the item key.

Both request paths (tool calls and grades) import these, so a trace id, a run label or an item key is
stored the same way whichever path saw it first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

TRACE_ID_MAX = 128  # rollouts.trace_id, tool_calls.trace_id, grades.trace_id
CALL_ID_MAX = 200  # tool_calls.call_id and request_id
RUN_MAX = 200  # the X-Sparring-Run label
RUN_HEADER = "X-Sparring-Run"  # labels a training run; stored with every rollout, call and grade

ITEM_ID_FIELDS = ("id", "item_id", "task_id", "uid")


def fit(value: str, limit: int) -> str:
    """`value` itself when it fits the column, else its head and a hash of the whole (stable, distinct)."""
    if len(value) <= limit:
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()
    return f"{value[: limit - len(digest) - 1]}~{digest}"


def item_key(item: Mapping[str, Any]) -> str | None:
    """A stable key for the dataset row: its id field if it has one, else a hash of the whole row."""
    if not item:
        return None
    for name in ITEM_ID_FIELDS:
        value = item.get(name)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return f"{name}:{value}"[:128]
    digest = hashlib.sha256(orjson.dumps(item, option=orjson.OPT_SORT_KEYS, default=str)).hexdigest()
    return f"sha256:{digest[:40]}"
