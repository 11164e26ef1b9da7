"""Values as the database can store them: Postgres text and JSON cannot hold NUL, stored as U+FFFD.

The rule is part of the wire contract (an item key hashes the row as stored), so it lives in
`sparring.wire`.
"""

from __future__ import annotations

from sparring.wire import NUL, REPLACEMENT, storable

__all__ = ["NUL", "REPLACEMENT", "storable"]
