"""In-process rollout state for the embedded default: one process only, nothing survives a restart."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from dataclasses import dataclass, field

from app.rollouts.store import (
    CallStart,
    PackChanges,
    RecordWrite,
    StoredAnswer,
    StoreUnavailable,
    Ticket,
    merge_writes,
)
from app.sdk.state import private_copy  # deepcopy's result on state's JSON-shaped records, faster


@dataclass
class _Rollout:
    first_seen: float
    last_seen: float
    graded: bool = False
    # A call with its state opened it (a grade's mark alone does not: see `seen`).
    opened: bool = False
    changes: PackChanges = field(default_factory=dict)
    # call_id → answer, or (token, the future that the running attempt will resolve)
    ledger: dict[str, StoredAnswer | tuple[str, asyncio.Future[StoredAnswer | None]]] = field(
        default_factory=dict
    )


class MemoryRolloutStore:
    kind = "memory"

    def __init__(self, *, ttl_seconds: float, lock_wait: float = 300.0, retry_after: int = 2) -> None:
        self._ttl = ttl_seconds
        self._lock_wait = lock_wait
        self._retry_after = retry_after  # the Retry-After of its 503s (SPARRING_RETRY_AFTER_SECONDS)
        self._rollouts: dict[str, _Rollout] = {}
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._last_sweep = time.time()
        # Small records (episode sessions): key → (fields, when they expire, monotonic).
        self._records: dict[str, tuple[dict[str, str], float]] = {}
        self._last_record_sweep = time.monotonic()

    def _rollout(self, trace_id: str) -> _Rollout:
        now = time.time()
        self._sweep(now)
        rollout = self._rollouts.get(trace_id)
        if rollout is None:
            rollout = self._rollouts[trace_id] = _Rollout(first_seen=now, last_seen=now)
        return rollout

    def _sweep(self, now: float) -> None:
        # Expire idle rollouts lazily, at most once per tenth of the TTL.
        if now - self._last_sweep < max(1.0, self._ttl / 10):
            return
        self._last_sweep = now
        for trace_id in [t for t, r in self._rollouts.items() if now - r.last_seen > self._ttl]:
            del self._rollouts[trace_id]

    async def begin(self, start: CallStart) -> Ticket | StoredAnswer:
        trace_id, call_id = start.trace_id, start.call_id
        ticket = Ticket(trace_id=trace_id, call_id=call_id, token=uuid.uuid4().hex, locked=False)
        if call_id is not None:
            answer = await self._claim(ticket, call_id, start.wait)
            if answer is not None:
                return answer
        if start.lock:
            held = self._locks.get(trace_id)
            if held is None:
                held = self._locks[trace_id] = asyncio.Lock()
            try:
                # Not wait_for: that starts a task for the acquire, a turn of the loop even when free.
                async with asyncio.timeout(self._lock_wait):
                    await held.acquire()
            except TimeoutError:
                self._settle(ticket, None)
                raise StoreUnavailable(
                    "timed out waiting for the rollout's lock", retry_after=self._retry_after
                ) from None
            except BaseException:
                self._settle(ticket, None)
                raise
            ticket.locked, ticket.held = True, held  # the ticket keeps the lock object alive
        if start.meta is not None:
            rollout = self._rollout(trace_id)
            rollout.last_seen = start.meta.now
            rollout.opened = True
            ticket.graded = rollout.graded
            if start.load_changes:
                ticket.changes = private_copy(rollout.changes)
        return ticket

    async def _claim(self, ticket: Ticket, call_id: str, wait: float) -> StoredAnswer | None:
        deadline = time.monotonic() + wait
        while True:
            rollout = self._rollout(ticket.trace_id)
            entry = rollout.ledger.get(call_id)
            if entry is None:
                future: asyncio.Future[StoredAnswer | None] = asyncio.get_running_loop().create_future()
                rollout.ledger[call_id] = (ticket.token, future)
                return None
            if isinstance(entry, StoredAnswer):
                return entry
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._still_running(call_id)
            try:
                answer = await asyncio.wait_for(asyncio.shield(entry[1]), remaining)
            except TimeoutError:
                raise self._still_running(call_id) from None
            if answer is not None:
                return answer
            # The first attempt failed without an answer: loop and claim it ourselves.

    def _still_running(self, call_id: str) -> StoreUnavailable:
        return StoreUnavailable(f"call {call_id} is still running elsewhere", retry_after=self._retry_after)

    def _settle(self, ticket: Ticket, answer: StoredAnswer | None) -> None:
        rollout = self._rollouts.get(ticket.trace_id)
        if rollout is None or ticket.call_id is None:
            return
        entry = rollout.ledger.get(ticket.call_id)
        if isinstance(entry, tuple) and entry[0] == ticket.token:
            if answer is None:
                del rollout.ledger[ticket.call_id]
            else:
                rollout.ledger[ticket.call_id] = answer
            if not entry[1].done():
                entry[1].set_result(answer)

    def _unlock(self, ticket: Ticket) -> None:
        held: asyncio.Lock | None = ticket.held
        if held is not None:
            ticket.held = None
            held.release()

    async def finish(self, ticket: Ticket, writes: PackChanges, answer: StoredAnswer) -> None:
        try:
            if writes:
                merge_writes(self._rollout(ticket.trace_id).changes, private_copy(writes))
            self._settle(ticket, answer)
        finally:
            self._unlock(ticket)

    async def abort(self, ticket: Ticket) -> None:
        self._settle(ticket, None)
        self._unlock(ticket)

    async def mark_graded(self, trace_id: str) -> None:
        self._rollout(trace_id).graded = True

    async def is_graded(self, trace_id: str) -> bool:
        rollout = self._rollouts.get(trace_id)
        return rollout is not None and rollout.graded

    async def changes(self, trace_id: str) -> PackChanges:
        rollout = self._rollouts.get(trace_id)
        return private_copy(rollout.changes) if rollout else {}

    async def seen(self, trace_id: str) -> bool:
        rollout = self._rollouts.get(trace_id)
        return rollout is not None and rollout.opened and time.time() - rollout.last_seen <= self._ttl

    def _record(self, key: str) -> dict[str, str] | None:
        now = time.monotonic()
        if len(self._records) > 1024 and now - self._last_record_sweep > 1.0:
            self._last_record_sweep = now
            for stale in [k for k, (_, expires) in self._records.items() if expires <= now]:
                del self._records[stale]
        found = self._records.get(key)
        if found is None or found[1] <= now:
            self._records.pop(key, None)
            return None
        return found[0]

    async def record_put(self, write: RecordWrite) -> bool:
        record = self._record(write.key)
        if write.create:
            if record is not None:
                return False
            record = {}
        elif record is None or (write.unless_field is not None and write.unless_field in record):
            return False
        record.update(write.fields)
        self._records[write.key] = (record, time.monotonic() + write.ttl_seconds)
        return True

    async def record_get(self, key: str, *, ttl_seconds: float) -> dict[str, str] | None:
        record = self._record(key)
        if record is None:
            return None
        self._records[key] = (record, time.monotonic() + ttl_seconds)
        return dict(record)

    async def record_add(self, key: str, field: str, amount: int, *, ttl_seconds: float) -> int | None:
        record = self._record(key)
        if record is None:
            return None
        value = int(record.get(field, "0")) + amount
        record[field] = str(value)
        self._records[key] = (record, time.monotonic() + ttl_seconds)
        return value

    async def record_delete(self, key: str) -> bool:
        return self._records.pop(key, None) is not None

    async def ping(self) -> None:
        return None

    async def aclose(self) -> None:
        self._rollouts.clear()
        self._records.clear()
