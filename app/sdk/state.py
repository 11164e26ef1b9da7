"""The rollout's state as a tool sees it: the pack's immutable base with this rollout's changes on top."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import orjson

Base = Mapping[str, Mapping[str, Any]]
Changes = dict[str, dict[str, Any]]

EMPTY_BASE: Base = {}


_ATOMS = frozenset({str, int, float, bool, type(None)})


def private_copy(value: Any) -> Any:
    """A copy that shares nothing mutable with `value`: `copy.deepcopy`, several times faster on the
    JSON-shaped records state holds (dicts, lists, strings, numbers); other types go to deepcopy."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is dict:
        return {key: private_copy(item) for key, item in value.items()}
    if kind is list:
        return [private_copy(item) for item in value]
    return copy.deepcopy(value)


class ReadOnlyState(RuntimeError):
    """A tool not declared `mutates=True` tried to write rollout state."""


class RolloutState:
    """Copy-on-write records grouped in collections.

    Reads see this rollout's changes first, then the base the pack loaded once per process. Writes
    are buffered and committed atomically with the call's answer when the tool returns, so a tool
    that fails half-way changes nothing. A record set to None is deleted.
    """

    def __init__(self, base: Base, changes: Changes, *, writable: bool) -> None:
        self._base = base
        self._changes = changes
        self._writes: Changes = {}
        self._writable = writable

    def _lookup(self, collection: str, key: str) -> tuple[bool, Any]:
        written = self._writes.get(collection)
        if written is not None and key in written:
            return True, written[key]
        changed = self._changes.get(collection)
        if changed is not None and key in changed:
            return True, changed[key]
        base = self._base.get(collection)
        if base is not None and key in base:
            return True, base[key]
        return False, None

    def get(self, collection: str, key: str, default: Any = None) -> Any:
        """A private copy of the record (safe to modify and `put` back), or `default`."""
        found, value = self._lookup(collection, key)
        if not found or value is None:
            return default
        return private_copy(value)

    def __contains__(self, item: tuple[str, str]) -> bool:
        found, value = self._lookup(*item)
        return found and value is not None

    def keys(self, collection: str) -> list[str]:
        merged = dict.fromkeys(self._base.get(collection, {}))
        for layer in (self._changes.get(collection, {}), self._writes.get(collection, {})):
            for key, value in layer.items():
                if value is None:
                    merged.pop(key, None)
                else:
                    merged[key] = None
        return list(merged)

    def changed(self, collection: str) -> set[str]:
        """The keys of a collection this rollout changed (written or deleted): every other record is the
        base's own, so two states over one base can differ only at the keys either of them changed."""
        return set(self._changes.get(collection, {})) | set(self._writes.get(collection, {}))

    def items(self, collection: str) -> Iterator[tuple[str, Any]]:
        """Every current record of a collection, without copying: read them, do not modify them."""
        for key in self.keys(collection):
            yield key, self._lookup(collection, key)[1]

    def put(self, collection: str, key: str, value: Any) -> None:
        """Keep `value` as the record: a private copy, as JSON keeps it (a tuple is a list, a date its ISO
        text, NaN null) so a later call reads it alike from memory and from Redis; a TypeError naming the
        record for what JSON cannot hold (a set, a key that is not a string, an int beyond 64 bits)."""
        if not self._writable:
            raise ReadOnlyState(f"tool is not declared mutates=True; it cannot write {collection}/{key}")
        try:
            record = orjson.loads(orjson.dumps(value))
        except orjson.JSONEncodeError as exc:
            raise TypeError(f"the state record {collection}/{key} is not JSON: {exc}") from None
        self._writes.setdefault(collection, {})[key] = record

    def delete(self, collection: str, key: str) -> None:
        self.put(collection, key, None)

    @property
    def writes(self) -> Changes:
        return self._writes

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """The whole materialized state (base plus changes) as plain JSON-ready data."""
        names = set(self._base) | set(self._changes) | set(self._writes)
        return {name: dict(self.items(name)) for name in sorted(names)}
