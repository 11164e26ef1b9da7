"""The interface every rollout state store implements, and the values that cross it."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.errors import ServiceUnavailable

# {pack: {collection: {key: record or None (deleted)}}}
PackChanges = dict[str, dict[str, dict[str, Any]]]


class StoreUnavailable(ServiceUnavailable):
    code = "state_store_unavailable"


@dataclass(frozen=True)
class StoredAnswer:
    """What a call answered, kept in the ledger so a retry gets the identical answer."""

    output: str
    outcome: str  # ok | model_error


@dataclass(frozen=True)
class Claim:
    """The right to run one (trace_id, call_id); `token` proves ownership when completing it."""

    token: str


@dataclass(frozen=True)
class RolloutMeta:
    run: str | None
    item_key: str | None
    now: float  # unix time


@dataclass
class RolloutSnapshot:
    graded: bool
    changes: PackChanges = field(default_factory=dict)


class RolloutStore(Protocol):
    """Rollout state keyed by trace_id: copy-on-write changes, a call ledger, locks and lifecycle."""

    kind: str

    async def claim(self, trace_id: str, call_id: str, *, wait: float) -> StoredAnswer | Claim:
        """Claim a call, or get the answer it already has (waiting while another worker runs it)."""
        ...

    async def release(self, trace_id: str, call_id: str, claim: Claim) -> None:
        """Give a claim up without an answer (the call failed), so that a retry runs it again."""
        ...

    def lock(self, trace_id: str) -> AbstractAsyncContextManager[None]:
        """Serialize state-changing calls of one rollout (other rollouts never wait)."""
        ...

    async def open(self, trace_id: str, meta: RolloutMeta, *, load_changes: bool) -> RolloutSnapshot:
        """Create or touch the rollout (refreshing its idle expiry) and read its changes."""
        ...

    async def commit(
        self,
        trace_id: str,
        writes: PackChanges,
        answer: tuple[str, Claim, StoredAnswer] | None,
    ) -> None:
        """Apply the writes and record the answer in the ledger, atomically."""
        ...

    async def mark_graded(self, trace_id: str) -> None: ...

    async def is_graded(self, trace_id: str) -> bool: ...

    async def changes(self, trace_id: str) -> PackChanges: ...

    async def ping(self) -> None: ...

    async def aclose(self) -> None: ...


def merge_writes(target: PackChanges, writes: PackChanges) -> None:
    """Fold one call's writes into a rollout's changes (None marks a deleted record)."""
    for pack, collections in writes.items():
        pack_changes = target.setdefault(pack, {})
        for collection, records in collections.items():
            pack_changes.setdefault(collection, {}).update(records)
