"""Values as the database can store them: Postgres text and JSON cannot hold NUL, stored as U+FFFD."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")

NUL = "\x00"
REPLACEMENT = "\ufffd"


def storable(value: T) -> T:
    """`value` with every NUL in its strings (dict keys included) replaced by U+FFFD.

    Applied on both backends, so a trace_id holding a NUL names the same rollout in the call log,
    the grades and every lookup. Values without a NUL are returned as they are.
    """
    if isinstance(value, str):
        return value.replace(NUL, REPLACEMENT) if NUL in value else value  # type: ignore[return-value]
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}  # type: ignore[return-value]
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]  # type: ignore[return-value]
    return value
