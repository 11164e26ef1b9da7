"""Rollout state in Redis: shared by every worker and replica, expiring after the idle TTL."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from string import Template
from typing import Any, TypeVar
from urllib.parse import quote

import orjson
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from app.rollouts.redis_cluster import ClusterScriptBatcher
from app.rollouts.redis_scripts import (
    ABORT,
    BEGIN,
    EXTEND,
    FINISH,
    SEP,
    BatcherBase,
    Script,
    ScriptBatcher,
    script_flags,
)
from app.rollouts.store import CallStart, PackChanges, RecordWrite, StoredAnswer, StoreUnavailable, Ticket

log = logging.getLogger(__name__)

T = TypeVar("T")


_PLAIN_ID = re.compile(r"[A-Za-z0-9_.~-]+")


def _key_part(value: str) -> str:
    """An id as it appears in a key: percent-encoded unless it is plain, so ids are never key syntax.

    Percent-encoding leaves letters, digits and `_.~-` alone and writes every other character as
    %XX bytes, '%' itself included, so two distinct ids never encode alike and no encoded id holds a
    brace (the hash tag) or a colon (the key's separator). Plain ids, the usual kind, are used as they
    are: `quote` would return them unchanged. The empty id is '%', which no other id encodes to.
    """
    if _PLAIN_ID.fullmatch(value):
        return value
    return quote(value, safe="") or "%"


DEFAULT_KEY_PREFIX = "sp"


def _prefix(trace_id: str, namespace: str = DEFAULT_KEY_PREFIX) -> str:
    # The hash tag keeps every key of a rollout in one Redis Cluster slot (atomic scripts need it).
    return f"{namespace}:{{{_key_part(trace_id)}}}"


def _keys(trace_id: str, call_id: str | None, namespace: str = DEFAULT_KEY_PREFIX) -> list[str]:
    prefix = _prefix(trace_id, namespace)
    # Without a call_id the ledger key is never read or written; it is named for the fixed layout only.
    call = _key_part(call_id) if call_id is not None else ""
    return [f"{prefix}:meta", f"{prefix}:state", f"{prefix}:call:{call}", f"{prefix}:lock"]


# A small record (an episode session): written only if new, or only if present and `ARGV[2]` unset.
_RECORD_PUT = """
local exists = redis.call('EXISTS', KEYS[1]) == 1
if ARGV[3] == '1' then
  if exists then return 0 end
else
  if not exists then return 0 end
  if ARGV[2] ~= '' and redis.call('HEXISTS', KEYS[1], ARGV[2]) == 1 then return 0 end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""
_RECORD_ADD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local value = redis.call('HINCRBY', KEYS[1], ARGV[2], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return value
"""

# One hash, atomically (a script, not MULTI: the same on one Redis and on a cluster): set the field
# ARGV[2] to ARGV[3] if given, extend the hash's expiry to ARGV[1] ms, and return its fields.
_TOUCH = """
if ARGV[2] then redis.call('HSET', KEYS[1], ARGV[2], ARGV[3]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if ARGV[2] then return {} end
return redis.call('HGETALL', KEYS[1])
"""


def _record_key(namespace: str, key: str) -> str:
    return f"{namespace}:rec:{_key_part(key)}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _LocalLock:
    """A rollout's lock in this process, with the number of calls holding or awaiting it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


@dataclass(eq=False)
class _Held:
    """What a ticket holds in this process: the rollout's local lock."""

    local: _LocalLock | None = None


class RedisRolloutStore:
    kind = "redis"

    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        ttl_seconds: float,
        lock_timeout: float,
        claim_timeout: float,
        lock_wait: float,
        op_timeout: float = 5.0,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        retry_after: int = 2,
    ) -> None:
        self._redis = client
        self._retry_after = retry_after  # the Retry-After of its 503s (SPARRING_RETRY_AFTER_SECONDS)
        self._namespace = key_prefix  # every key is `<key_prefix>:{<trace id>}:...`
        self._lock_wait = lock_wait
        self._ttl_ms = int(ttl_seconds * 1000)
        self._lock_ms = int(lock_timeout * 1000)
        self._claim_ms = int(claim_timeout * 1000)
        self._op_timeout = op_timeout
        expiries = {"claim_ms": self._claim_ms, "lock_ms": self._lock_ms, "ttl_ms": self._ttl_ms}
        self._begin, self._finish, self._abort, self._extend = (
            Script(Template(source).substitute(expiries)) for source in (BEGIN, FINISH, ABORT, EXTEND)
        )
        self._batcher: BatcherBase = (
            ClusterScriptBatcher(client, op_timeout)
            if isinstance(client, RedisCluster)
            else ScriptBatcher(client, op_timeout)
        )
        self._record_put, self._record_add, self._touch = (
            Script(_RECORD_PUT),
            Script(_RECORD_ADD),
            Script(_TOUCH),
        )
        # Running calls that hold a claim or a lock → when it was last extended. One task extends
        # those due every third of the shorter expiry (a timer per call cost more than the call).
        self._live: dict[Ticket, float] = {}
        self._extend_after = min(claim_timeout, lock_timeout) / 3
        self._keeper: asyncio.Task[None] | None = None
        # Rollout → its local lock, while some call of this process holds or awaits it.
        self._local_locks: dict[str, _LocalLock] = {}
        # Claim and lock tokens: unique per store (a random prefix) and per call (a counter).
        self._token_prefix = os.urandom(8).hex()
        self._token_count = itertools.count()

    def _key(self, trace_id: str, part: str) -> str:
        return f"{_prefix(trace_id, self._namespace)}:{part}"

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        # The caller gets a stable message; what the driver said (hosts, ports, error kinds) is logged.
        log.warning("rollout state store failed: %s: %s", type(exc).__name__, exc)
        if isinstance(exc, TimeoutError):
            return self._refused(f"rollout state store did not answer within {self._op_timeout:g} s")
        return self._refused("rollout state store unreachable")

    def _refused(self, message: str) -> StoreUnavailable:
        return StoreUnavailable(message, retry_after=self._retry_after)

    async def _guard(self, operation: Awaitable[T]) -> T:
        """Run one Redis operation under one deadline; an unreachable or hung Redis is a 503.

        Any exception is an outage here, whatever its class: besides the client's own errors, the
        event loop raises RuntimeError (uvloop) or OSError when a reset connection is written to.
        """
        try:
            async with asyncio.timeout(self._op_timeout), self._batcher.direct():
                return await operation
        except Exception as exc:
            raise self._unavailable(exc) from exc

    async def _run(self, script: Script, trace_id: str, call_id: str | None, args: list[Any]) -> Any:
        """Run one of the call scripts, batched with others (the batch carries the deadline)."""
        try:
            return await self._batcher.run(script, _keys(trace_id, call_id, self._namespace), args)
        except Exception as exc:  # every failure of Redis, whatever raised it (see _guard)
            raise self._unavailable(exc) from exc

    # --- one call: begin, then finish or abort ------------------------------------------------------

    async def begin(self, start: CallStart) -> Ticket | StoredAnswer:
        trace_id, call_id, lock, meta = start.trace_id, start.call_id, start.lock, start.meta
        load = meta is not None and start.load_changes
        token = f"{self._token_prefix}{next(self._token_count):x}"
        ticket = Ticket(trace_id=trace_id, call_id=call_id, token=token, locked=lock)
        if call_id is None and not lock and meta is None:
            return ticket
        args: list[Any] = [
            ticket.token,
            script_flags(call_id is not None, lock, meta is not None, load),
        ]
        if meta is not None:
            args += [repr(meta.now), meta.run or "", meta.item_key or ""]
        now = time.monotonic()
        call_deadline, lock_deadline = now + start.wait, now + self._lock_wait
        held = ticket.held = _Held()
        if lock:
            # Calls of this rollout in this process queue here, in order, instead of polling Redis;
            # the Redis lock below then only ever waits for calls running in other processes.
            local = self._local_locks.get(trace_id)
            if local is None:
                local = self._local_locks[trace_id] = _LocalLock()
            local.users += 1
            try:
                if local.lock.locked():
                    try:
                        async with asyncio.timeout(self._lock_wait):
                            await local.lock.acquire()
                    except TimeoutError:
                        raise self._refused("timed out waiting for the rollout's lock") from None
                else:
                    await local.lock.acquire()
            except BaseException:
                self._leave(trace_id, local)
                raise
            held.local = local
        try:
            began = await self._begin_in_redis(ticket, args, call_deadline, lock_deadline)
        except StoreUnavailable:
            # Redis may have applied the script without our hearing back (a timeout, a dropped
            # connection): give up what may be ours now rather than leave it until it lapses.
            await self.abort(ticket)
            raise
        except BaseException:
            self._let_go(ticket)
            raise
        if isinstance(began, StoredAnswer):
            self._let_go(ticket)
        elif call_id is not None or lock:
            self._keep_alive(ticket)
        return began

    async def _begin_in_redis(
        self, ticket: Ticket, args: list[Any], call_deadline: float, lock_deadline: float
    ) -> Ticket | StoredAnswer:
        busy_pause = lock_pause = 0.002
        while True:
            reply: list[Any] = await self._run(self._begin, ticket.trace_id, ticket.call_id, args)
            kind = _text(reply[0])
            if kind == "ok":
                ticket.graded = bool(reply[1])
                if len(reply) > 2:
                    ticket.changes = _decode_pairs(reply[2])
                return ticket
            if kind == "answer":
                data = orjson.loads(reply[1])
                return StoredAnswer(output=data["output"], outcome=data["outcome"], call=data.get("call", ""))
            # Wait and try again: for another attempt of this call to answer (or its claim to lapse),
            # or for the call holding the rollout's lock (in another process) to finish.
            if kind == "busy":
                if time.monotonic() >= call_deadline:
                    raise self._refused(f"call {ticket.call_id} is still running elsewhere")
                await asyncio.sleep(busy_pause)
                busy_pause = min(busy_pause * 2, 0.1)
            else:
                if time.monotonic() >= lock_deadline:
                    raise self._refused("timed out waiting for the rollout's lock")
                await asyncio.sleep(lock_pause)
                lock_pause = min(lock_pause * 1.5, 0.05)

    def _keep_alive(self, ticket: Ticket) -> None:
        self._live[ticket] = time.monotonic()
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.get_running_loop().create_task(self._keep_running_calls_alive())

    async def _keep_running_calls_alive(self) -> None:
        """Extend the claims and locks of calls that have run for a third of their expiry."""
        while self._live:
            await asyncio.sleep(self._extend_after / 2)
            now = time.monotonic()
            due = [ticket for ticket, since in self._live.items() if now - since >= self._extend_after]
            results = await asyncio.gather(
                *(
                    self._run(
                        self._extend,
                        ticket.trace_id,
                        ticket.call_id,
                        [ticket.token, script_flags(ticket.call_id is not None, ticket.locked)],
                    )
                    for ticket in due
                ),
                return_exceptions=True,
            )
            for ticket, kept in zip(due, results, strict=True):
                if ticket not in self._live:
                    continue  # it finished meanwhile
                if isinstance(kept, BaseException):
                    # Try again at the next pass; the expiry leaves time for more attempts.
                    log.warning(
                        "could not extend the call %s of rollout %s: %s",
                        ticket.call_id,
                        ticket.trace_id,
                        kept,
                    )
                elif kept:
                    self._live[ticket] = now
                else:
                    del self._live[ticket]  # no longer ours: nothing left to keep alive

    def _let_go(self, ticket: Ticket) -> None:
        """Stop keeping the claim and lock alive, and let this process's next call of the rollout in."""
        self._live.pop(ticket, None)
        held: _Held | None = ticket.held
        if held is None:
            return
        ticket.held = None
        if held.local is not None:
            held.local.lock.release()
            self._leave(ticket.trace_id, held.local)

    def _leave(self, trace_id: str, local: _LocalLock) -> None:
        local.users -= 1
        if local.users == 0:  # nobody else can hold it: a new call makes a new one
            del self._local_locks[trace_id]

    async def finish(self, ticket: Ticket, writes: PackChanges, answer: StoredAnswer) -> None:
        try:
            await self._finish_in_redis(ticket, writes, answer)
        finally:
            # Only now: this process's next call of the rollout must find the Redis lock free.
            self._let_go(ticket)

    async def _finish_in_redis(self, ticket: Ticket, writes: PackChanges, answer: StoredAnswer) -> None:
        ledger = ticket.call_id is not None
        if not ledger and not ticket.locked and not writes:
            return
        args: list[Any] = [
            ticket.token,
            script_flags(ledger, ticket.locked),
            orjson.dumps({"output": answer.output, "outcome": answer.outcome, "call": answer.call})
            if ledger
            else "",
        ]
        for pack, collections in writes.items():
            for collection, records in collections.items():
                for key, value in records.items():
                    args.append(SEP.join((pack, collection, key)))
                    args.append(orjson.dumps(value))
        applied = await self._run(self._finish, ticket.trace_id, ticket.call_id, args)
        if applied == 0:
            raise self._refused("this call's claim lapsed while it ran; a retry will get the stored answer")
        if applied == -1:
            raise self._refused(
                "the rollout's lock lapsed while this call ran; nothing was applied, a retry runs it again"
            )

    async def abort(self, ticket: Ticket) -> None:
        try:
            if ticket.call_id is not None or ticket.locked:
                flags = script_flags(ticket.call_id is not None, ticket.locked)
                try:
                    await self._run(self._abort, ticket.trace_id, ticket.call_id, [ticket.token, flags])
                except StoreUnavailable as exc:
                    # Whatever is left lapses by itself (claim_timeout, lock_timeout).
                    log.warning(
                        "could not release the call %s of rollout %s: %s",
                        ticket.call_id,
                        ticket.trace_id,
                        exc,
                    )
        finally:
            self._let_go(ticket)

    # --- state and lifecycle -------------------------------------------------------------------------

    async def mark_graded(self, trace_id: str) -> None:
        await self._guard(
            self._touch(self._redis, [self._key(trace_id, "meta")], [self._ttl_ms, "graded", 1])
        )

    async def is_graded(self, trace_id: str) -> bool:
        return bool(await self._guard(self._redis.hget(self._key(trace_id, "meta"), "graded")))

    async def changes(self, trace_id: str) -> PackChanges:
        raw = await self._guard(self._redis.hgetall(self._key(trace_id, "state")))
        return _decode_changes(raw)

    async def seen(self, trace_id: str) -> bool:
        # Every call that reads or changes the rollout's state sets its meta's first_seen (see BEGIN); a
        # grade's mark alone (after the state expired) does not make the rollout's state held again.
        return bool(await self._guard(self._redis.hexists(self._key(trace_id, "meta"), "first_seen")))

    # --- small records (episode sessions) ------------------------------------------------------------

    async def record_put(self, write: RecordWrite) -> bool:
        pairs = [part for item in write.fields.items() for part in item]
        args = [int(write.ttl_seconds * 1000), write.unless_field or "", "1" if write.create else "0", *pairs]
        return bool(
            await self._guard(self._record_put(self._redis, [_record_key(self._namespace, write.key)], args))
        )

    async def record_get(self, key: str, *, ttl_seconds: float) -> dict[str, str] | None:
        args = [int(ttl_seconds * 1000)]
        flat = await self._guard(self._touch(self._redis, [_record_key(self._namespace, key)], args))
        return {_text(k): _text(v) for k, v in zip(flat[::2], flat[1::2], strict=True)} if flat else None

    async def record_add(self, key: str, field: str, amount: int, *, ttl_seconds: float) -> int | None:
        args = [int(ttl_seconds * 1000), field, amount]
        value = await self._guard(self._record_add(self._redis, [_record_key(self._namespace, key)], args))
        return None if value is None else int(value)

    async def record_delete(self, key: str) -> bool:
        return bool(await self._guard(self._redis.delete(_record_key(self._namespace, key))))

    async def ping(self) -> None:
        if isinstance(self._redis, RedisCluster):
            await self._guard(_ping_any_primary(self._redis))
        else:
            await self._guard(self._redis.ping())

    async def aclose(self) -> None:
        self._live.clear()
        if self._keeper is not None:
            self._keeper.cancel()
        await self._batcher.aclose()
        await self._redis.aclose()


async def _ping_any_primary(cluster: RedisCluster) -> None:
    """Ready as soon as some shard answers: the rollouts of a lost shard get 503s, the others are served
    (a readiness probe must not wait for a shard that does not answer)."""
    await cluster.initialize()
    pings = [asyncio.ensure_future(cluster.ping(target_nodes=node)) for node in cluster.get_primaries()]
    failure: BaseException = StoreUnavailable("the Redis Cluster has no primary")
    try:
        for done in asyncio.as_completed(pings):
            try:
                await done
                return
            except Exception as exc:  # this shard is down: another may answer
                failure = exc
        raise failure
    finally:
        for ping in pings:
            ping.cancel()


def _decode_changes(raw: dict[Any, Any]) -> PackChanges:
    return _decode_items(raw.items())


def _decode_pairs(flat: list[Any]) -> PackChanges:
    """HGETALL's reply inside a script: field, value, field, value, ..."""
    return _decode_items(zip(flat[::2], flat[1::2], strict=True))


def _decode_items(items: Iterable[tuple[Any, Any]]) -> PackChanges:
    changes: PackChanges = {}
    for field_name, value in items:
        pack, collection, key = _text(field_name).split(SEP, 2)
        changes.setdefault(pack, {}).setdefault(collection, {})[key] = orjson.loads(value)
    return changes
