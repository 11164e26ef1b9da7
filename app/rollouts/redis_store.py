"""Rollout state in Redis: shared by every worker and replica, expiring after the idle TTL."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import orjson
from redis.asyncio import Redis
from redis.exceptions import LockError, RedisError

from app.rollouts.store import (
    Claim,
    PackChanges,
    RolloutMeta,
    RolloutSnapshot,
    StoredAnswer,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_SEP = "\x1f"
_PENDING = "P:"
_ANSWERED = "A:"

# Apply a call's writes and record its answer only while the caller still owns the claim, so a call
# whose claim expired (its worker stalled) can never apply its writes after a retry has taken over.
# KEYS: state, meta, ledger (or none). ARGV: ttl_ms, token, answer, then field/value pairs.
_COMMIT = """
local ttl = tonumber(ARGV[1])
if #KEYS == 3 then
  if redis.call('GET', KEYS[3]) ~= 'P:' .. ARGV[2] then return 0 end
end
for i = 4, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
if #ARGV >= 4 then redis.call('PEXPIRE', KEYS[1], ttl) end
redis.call('PEXPIRE', KEYS[2], ttl)
if #KEYS == 3 then redis.call('SET', KEYS[3], 'A:' .. ARGV[3], 'PX', ttl) end
return 1
"""

# Drop a claim only if it is still ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == 'P:' .. ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# Extend a claim only if it is still ours.
_EXTEND = """
if redis.call('GET', KEYS[1]) == 'P:' .. ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


def _prefix(trace_id: str) -> str:
    # The hash tag keeps every key of a rollout in one Redis Cluster slot (atomic scripts need it).
    return f"sp:{{{trace_id}}}"


class RedisRolloutStore:
    kind = "redis"

    def __init__(
        self,
        client: Redis,
        *,
        ttl_seconds: float,
        lock_timeout: float,
        claim_timeout: float,
        lock_wait: float,
    ) -> None:
        self._redis = client
        self._lock_wait = lock_wait
        self._ttl_ms = int(ttl_seconds * 1000)
        self._lock_timeout = lock_timeout
        self._claim_ms = int(claim_timeout * 1000)
        self._commit = client.register_script(_COMMIT)
        self._release = client.register_script(_RELEASE)
        self._extend = client.register_script(_EXTEND)
        self._keepalives: dict[tuple[str, str], asyncio.Task[None]] = {}

    async def _guard(self, operation: Awaitable[T]) -> T:
        try:
            return await operation
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"rollout state store unreachable: {type(exc).__name__}: {exc}") from exc

    # --- the call ledger -------------------------------------------------------------------------

    async def claim(self, trace_id: str, call_id: str, *, wait: float) -> StoredAnswer | Claim:
        key = f"{_prefix(trace_id)}:call:{call_id}"
        token = uuid.uuid4().hex
        deadline = time.monotonic() + wait
        pause = 0.005
        while True:
            if await self._guard(self._redis.set(key, _PENDING + token, nx=True, px=self._claim_ms)):
                claim = Claim(token=token)
                self._start_keepalive(trace_id, call_id, claim)
                return claim
            value = await self._guard(self._redis.get(key))
            if value is not None:
                text = value.decode() if isinstance(value, bytes) else str(value)
                if text == _PENDING + token:
                    # Our SET NX was applied but its reply was lost and the client retried: the claim is ours.
                    claim = Claim(token=token)
                    self._start_keepalive(trace_id, call_id, claim)
                    return claim
                if text.startswith(_ANSWERED):
                    data = orjson.loads(text[len(_ANSWERED) :])
                    return StoredAnswer(output=data["output"], outcome=data["outcome"])
            if time.monotonic() >= deadline:
                raise TimeoutError(f"call {call_id} is still running elsewhere")
            # Another worker runs this call: wait for its answer (or for its claim to lapse).
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)

    def _start_keepalive(self, trace_id: str, call_id: str, claim: Claim) -> None:
        key = f"{_prefix(trace_id)}:call:{call_id}"

        async def extend() -> None:
            while True:
                await asyncio.sleep(self._claim_ms / 3000)
                with contextlib.suppress(RedisError, OSError):
                    if not await self._extend(keys=[key], args=[claim.token, self._claim_ms]):
                        return

        self._keepalives[(trace_id, call_id)] = asyncio.create_task(extend())

    def _stop_keepalive(self, trace_id: str, call_id: str) -> None:
        task = self._keepalives.pop((trace_id, call_id), None)
        if task is not None:
            task.cancel()

    async def release(self, trace_id: str, call_id: str, claim: Claim) -> None:
        self._stop_keepalive(trace_id, call_id)
        key = f"{_prefix(trace_id)}:call:{call_id}"
        await self._guard(self._release(keys=[key], args=[claim.token]))

    # --- locks -------------------------------------------------------------------------------------

    @asynccontextmanager
    async def lock(self, trace_id: str) -> AsyncIterator[None]:
        lock = self._redis.lock(
            f"{_prefix(trace_id)}:lock",
            timeout=self._lock_timeout,
            sleep=0.005,
            blocking_timeout=self._lock_wait,
            thread_local=False,
        )
        if not await self._guard(lock.acquire()):
            raise StoreUnavailable("timed out waiting for the rollout's lock")

        async def keep() -> None:
            # A long call keeps its lock; a crashed worker's lock lapses after lock_timeout.
            while True:
                await asyncio.sleep(self._lock_timeout / 3)
                with contextlib.suppress(RedisError, OSError):
                    await lock.reacquire()

        keeper = asyncio.create_task(keep())
        try:
            yield
        finally:
            keeper.cancel()
            try:
                await lock.release()
            except LockError:
                # The lock lapsed (the call outlived lock_timeout without a keep-alive): nothing to free.
                log.warning("the lock of rollout %s lapsed before it was released", trace_id)
            except (RedisError, OSError) as exc:
                # What the call did is already committed; the lock lapses by itself after lock_timeout.
                log.warning("could not release the lock of rollout %s: %s", trace_id, exc)

    # --- state and lifecycle -------------------------------------------------------------------------

    async def open(self, trace_id: str, meta: RolloutMeta, *, load_changes: bool) -> RolloutSnapshot:
        prefix = _prefix(trace_id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hsetnx(f"{prefix}:meta", "first_seen", meta.now)
        if meta.run:
            pipe.hsetnx(f"{prefix}:meta", "run", meta.run)
        if meta.item_key:
            pipe.hsetnx(f"{prefix}:meta", "item_key", meta.item_key)
        pipe.hset(f"{prefix}:meta", "last_seen", meta.now)
        pipe.pexpire(f"{prefix}:meta", self._ttl_ms)
        pipe.hget(f"{prefix}:meta", "graded")
        if load_changes:
            pipe.hgetall(f"{prefix}:state")
            pipe.pexpire(f"{prefix}:state", self._ttl_ms)
        results: list[Any] = await self._guard(pipe.execute())
        if load_changes:
            graded, raw = results[-3], results[-2]
            return RolloutSnapshot(graded=bool(graded), changes=_decode_changes(raw))
        return RolloutSnapshot(graded=bool(results[-1]))

    async def commit(
        self, trace_id: str, writes: PackChanges, answer: tuple[str, Claim, StoredAnswer] | None
    ) -> None:
        prefix = _prefix(trace_id)
        keys = [f"{prefix}:state", f"{prefix}:meta"]
        args: list[Any] = [self._ttl_ms, "", ""]
        if answer is not None:
            call_id, claim, stored = answer
            keys.append(f"{prefix}:call:{call_id}")
            args[1] = claim.token
            args[2] = orjson.dumps({"output": stored.output, "outcome": stored.outcome})
        for pack, collections in writes.items():
            for collection, records in collections.items():
                for key, value in records.items():
                    args.append(_SEP.join((pack, collection, key)))
                    args.append(orjson.dumps(value))
        if answer is not None:
            self._stop_keepalive(trace_id, answer[0])
        applied = await self._guard(self._commit(keys=keys, args=args))
        if not applied:
            raise StoreUnavailable(
                "this call's claim lapsed while it ran; a retry will get the stored answer"
            )

    async def mark_graded(self, trace_id: str) -> None:
        key = f"{_prefix(trace_id)}:meta"
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(key, "graded", 1)
        pipe.pexpire(key, self._ttl_ms)
        await self._guard(pipe.execute())

    async def is_graded(self, trace_id: str) -> bool:
        return bool(await self._guard(self._redis.hget(f"{_prefix(trace_id)}:meta", "graded")))

    async def changes(self, trace_id: str) -> PackChanges:
        raw = await self._guard(self._redis.hgetall(f"{_prefix(trace_id)}:state"))
        return _decode_changes(raw)

    async def ping(self) -> None:
        await self._guard(self._redis.ping())

    async def aclose(self) -> None:
        for task in self._keepalives.values():
            task.cancel()
        self._keepalives.clear()
        await self._redis.aclose()


def _decode_changes(raw: dict[Any, Any]) -> PackChanges:
    changes: PackChanges = {}
    for field_name, value in raw.items():
        name = field_name.decode() if isinstance(field_name, bytes) else str(field_name)
        pack, collection, key = name.split(_SEP, 2)
        changes.setdefault(pack, {}).setdefault(collection, {})[key] = orjson.loads(value)
    return changes
