"""In-process rollout state for the embedded default: one process only, nothing survives a restart."""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from app.rollouts.store import Claim, PackChanges, RolloutMeta, RolloutSnapshot, StoredAnswer, merge_writes


@dataclass
class _Rollout:
    first_seen: float
    last_seen: float
    graded: bool = False
    changes: PackChanges = field(default_factory=dict)
    # call_id → answer, or the future that the running call will resolve
    ledger: dict[str, StoredAnswer | tuple[Claim, asyncio.Future[StoredAnswer | None]]] = field(
        default_factory=dict
    )


class MemoryRolloutStore:
    kind = "memory"

    def __init__(self, *, ttl_seconds: float) -> None:
        self._ttl = ttl_seconds
        self._rollouts: dict[str, _Rollout] = {}
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._last_sweep = time.time()

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

    async def claim(self, trace_id: str, call_id: str, *, wait: float) -> StoredAnswer | Claim:
        deadline = time.monotonic() + wait
        while True:
            rollout = self._rollout(trace_id)
            entry = rollout.ledger.get(call_id)
            if entry is None:
                claim = Claim(token=uuid.uuid4().hex)
                future: asyncio.Future[StoredAnswer | None] = asyncio.get_running_loop().create_future()
                rollout.ledger[call_id] = (claim, future)
                return claim
            if isinstance(entry, StoredAnswer):
                return entry
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"call {call_id} is still running elsewhere")
            try:
                answer = await asyncio.wait_for(asyncio.shield(entry[1]), remaining)
            except TimeoutError:
                raise TimeoutError(f"call {call_id} is still running elsewhere") from None
            if answer is not None:
                return answer
            # The first attempt failed without an answer: loop and claim it ourselves.

    def _settle(self, trace_id: str, call_id: str, claim: Claim, answer: StoredAnswer | None) -> None:
        rollout = self._rollouts.get(trace_id)
        if rollout is None:
            return
        entry = rollout.ledger.get(call_id)
        if isinstance(entry, tuple) and entry[0] == claim:
            if answer is None:
                del rollout.ledger[call_id]
            else:
                rollout.ledger[call_id] = answer
            if not entry[1].done():
                entry[1].set_result(answer)

    async def release(self, trace_id: str, call_id: str, claim: Claim) -> None:
        self._settle(trace_id, call_id, claim, None)

    @asynccontextmanager
    async def lock(self, trace_id: str) -> AsyncIterator[None]:
        lock = self._locks.get(trace_id)
        if lock is None:
            lock = self._locks[trace_id] = asyncio.Lock()
        async with lock:
            yield

    async def open(self, trace_id: str, meta: RolloutMeta, *, load_changes: bool) -> RolloutSnapshot:
        rollout = self._rollout(trace_id)
        rollout.last_seen = meta.now
        changes = copy.deepcopy(rollout.changes) if load_changes else {}
        return RolloutSnapshot(graded=rollout.graded, changes=changes)

    async def commit(
        self, trace_id: str, writes: PackChanges, answer: tuple[str, Claim, StoredAnswer] | None
    ) -> None:
        rollout = self._rollout(trace_id)
        merge_writes(rollout.changes, copy.deepcopy(writes))
        if answer is not None:
            call_id, claim, stored = answer
            self._settle(trace_id, call_id, claim, stored)

    async def mark_graded(self, trace_id: str) -> None:
        self._rollout(trace_id).graded = True

    async def is_graded(self, trace_id: str) -> bool:
        rollout = self._rollouts.get(trace_id)
        return rollout is not None and rollout.graded

    async def changes(self, trace_id: str) -> PackChanges:
        rollout = self._rollouts.get(trace_id)
        return copy.deepcopy(rollout.changes) if rollout else {}

    async def ping(self) -> None:
        return None

    async def aclose(self) -> None:
        self._rollouts.clear()
