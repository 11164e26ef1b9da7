"""Values as the database can store them: Postgres text and JSON cannot hold NUL, stored as U+FFFD."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")

NUL = "\x00"
REPLACEMENT = "\ufffd"
CONTROL_CHARACTERS = frozenset(chr(c) for c in range(32)) | {"\x7f"}


def has_control_character(value: str) -> bool:
    """Whether `value` holds NUL, CR, LF or another control character: no id or label the server
    stores does (the database cannot hold NUL, a header cannot hold CR or LF)."""
    return not CONTROL_CHARACTERS.isdisjoint(value)


def nul_inside(value: object) -> bool:
    """Whether a NUL is in any string of `value` (dict keys included), walked without recursion."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if NUL in node:
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return False


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
