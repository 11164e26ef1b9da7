"""The interface every rollout state store implements, and the values that cross it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.errors import ServiceUnavailable

# {pack: {collection: {key: record or None (deleted)}}}
PackChanges = dict[str, dict[str, dict[str, Any]]]
# The "pack" under which a rollout's state keeps its conversations with the simulated user (the call
# service writes them, the state-check graders read how they ended).
CONVERSATIONS = "_user"


class StoreUnavailable(ServiceUnavailable):
    code = "state_store_unavailable"


@dataclass(frozen=True)
class StoredAnswer:
    """What a call answered, kept in the ledger so a retry gets the identical answer."""

    output: str
    outcome: str  # ok | model_error
    # A digest of the call that produced the answer (its tool and canonical arguments): a retry must
    # be the same call to replay it. Empty for an answer not bound to a call (nothing to compare).
    call: str = ""


@dataclass(frozen=True)
class RolloutMeta:
    run: str | None
    item_key: str | None
    now: float  # unix time


@dataclass(frozen=True, slots=True)
class CallStart:
    """What a call asks of the store before its tool runs (see `RolloutStore.begin`)."""

    trace_id: str
    call_id: str | None
    lock: bool = False
    meta: RolloutMeta | None = None
    load_changes: bool = False
    wait: float = 0.0


@dataclass(frozen=True, slots=True)
class RecordWrite:
    """A write of a small record beside the rollouts (`RolloutStore.record_put`).

    `create`: only if no record `key` exists (a new one). Otherwise only if it exists (an ended or
    expired record is never brought back) and, with `unless_field`, that field is not set yet.
    """

    key: str
    fields: Mapping[str, str]
    ttl_seconds: float
    create: bool = False
    unless_field: str | None = None


@dataclass(eq=False)
class Ticket:
    """What `begin` holds for one call until `finish` or `abort`: its claim, the lock, what it read.

    `token` proves ownership of the claim and the lock when the call completes; `graded` and
    `changes` are the rollout as it was when the call began (read under the lock for a mutating call).
    """

    trace_id: str
    call_id: str | None
    token: str
    locked: bool
    graded: bool = False
    changes: PackChanges = field(default_factory=dict)
    # The store's own bookkeeping (a keep-alive timer, a held lock); nobody else reads it.
    held: Any = field(default=None, repr=False)


class RolloutStore(Protocol):
    """Rollout state keyed by trace_id: copy-on-write changes, a call ledger, locks and lifecycle.

    A call goes through `begin` once and then through exactly one of `finish` or `abort`.
    """

    kind: str

    async def begin(self, start: CallStart) -> Ticket | StoredAnswer:
        """Everything a call needs before its tool runs, in one step.

        - With a `call_id`, claim the call in the ledger, or return the answer it already has (a retry);
          while another attempt of it runs, wait for that attempt's answer, up to `wait` seconds.
        - With `lock`, take the rollout's lock (state-changing tools), waiting for it if it is held.
        - With `meta`, create or touch the rollout (refreshing its idle expiry) and read whether it is
          graded and, with `load_changes`, its changes.

        Raises StoreUnavailable when the store is unreachable or a wait runs out.
        """
        ...

    async def finish(self, ticket: Ticket, writes: PackChanges, answer: StoredAnswer) -> None:
        """Apply the writes, record the answer under the call's call_id and release the lock, atomically.

        Refuses (StoreUnavailable, nothing applied) when the claim or the lock lapsed while the call
        ran, so a stalled worker can never apply its writes after another attempt has taken over.
        """
        ...

    async def abort(self, ticket: Ticket) -> None:
        """Give the claim and the lock up without an answer (the call failed): a retry runs it again.

        Does not raise when the store is unreachable: what it could not release lapses by itself.
        """
        ...

    async def mark_graded(self, trace_id: str) -> None: ...

    async def is_graded(self, trace_id: str) -> bool: ...

    async def changes(self, trace_id: str) -> PackChanges: ...

    async def seen(self, trace_id: str) -> bool:
        """Whether the store holds the rollout (a call with its state touched it, and it has not expired)."""
        ...

    # --- small records beside the rollouts (episode sessions): a hash of text fields with an expiry ---

    async def record_put(self, write: RecordWrite) -> bool:
        """Write the fields of the record and restart its expiry, atomically; whether it was written
        (see `RecordWrite` for when it is)."""
        ...

    async def record_get(self, key: str, *, ttl_seconds: float) -> dict[str, str] | None:
        """The record's fields (None once deleted or expired); reading it restarts its expiry."""
        ...

    async def record_add(self, key: str, field: str, amount: int, *, ttl_seconds: float) -> int | None:
        """Add `amount` to an integer field of a record, atomically; the new value (None: no record)."""
        ...

    async def record_delete(self, key: str) -> bool:
        """Delete the record; whether it existed."""
        ...

    async def ping(self) -> None: ...

    async def aclose(self) -> None: ...


def merge_writes(target: PackChanges, writes: PackChanges) -> None:
    """Fold one call's writes into a rollout's changes (None marks a deleted record)."""
    for pack, collections in writes.items():
        pack_changes = target.setdefault(pack, {})
        for collection, records in collections.items():
            pack_changes.setdefault(collection, {}).update(records)
