"""Values as the database can store them: Postgres text and JSON cannot hold NUL, stored as U+FFFD.

The rule is part of the wire contract (an item key hashes the row as stored), so it lives in
`sparring.wire`.
"""

from __future__ import annotations

from sparring.wire import NUL, REPLACEMENT, storable

__all__ = ["CONTROL_CHARACTERS", "NUL", "REPLACEMENT", "has_control_character", "nul_inside", "storable"]

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
