"""Rollout state in Redis: shared by every worker and replica, expiring after the idle TTL."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from string import Template
from typing import Any, TypeVar

import orjson
from redis.asyncio import Redis
from redis.exceptions import ConnectionError, NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app.rollouts.store import PackChanges, RolloutMeta, StoredAnswer, StoreUnavailable, Ticket

log = logging.getLogger(__name__)

T = TypeVar("T")

_SEP = "\x1f"
_PENDING = "P:"
_ANSWERED = "A:"

# Every script names the rollout's four keys in this order (one Redis Cluster slot, see _keys):
# meta, state, the call's ledger entry, the rollout's lock. ARGV[1] is the call's token and ARGV[2]
# a string of flags, one character each ('1' or '0'). The store's expiries ($claim_ms, $lock_ms,
# $ttl_ms) are written into the scripts when the store is built, so no call sends them.

# Before a call runs, in one round trip: find its answer or claim it, take the lock, touch the rollout
# and read its changes. Flags: ledger, lock, open (touch the rollout), load (read its changes); with
# open, ARGV 3-5 are now, run and item_key. Returns {'answer', stored}, {'busy'} (another attempt of
# this call runs), {'locked'} (another call holds the lock; nothing was claimed), or
# {'ok', graded, state...}. A claim or a lock that already carries our token is ours: the client
# retried a script whose reply was lost after Redis had applied it.
_BEGIN = """
local token = ARGV[1]
local ledger = string.sub(ARGV[2], 1, 1) == '1'
if ledger then
  local entry = redis.call('GET', KEYS[3])
  if entry then
    if string.sub(entry, 1, 2) == 'A:' then return {'answer', string.sub(entry, 3)} end
    if entry ~= 'P:' .. token then return {'busy'} end
  end
end
if string.sub(ARGV[2], 2, 2) == '1' then
  local holder = redis.call('GET', KEYS[4])
  if holder and holder ~= token then return {'locked'} end
  redis.call('SET', KEYS[4], token, 'PX', $lock_ms)
end
if ledger then redis.call('SET', KEYS[3], 'P:' .. token, 'PX', $claim_ms) end
if string.sub(ARGV[2], 3, 3) ~= '1' then return {'ok', ''} end
redis.call('HSETNX', KEYS[1], 'first_seen', ARGV[3])
if ARGV[4] ~= '' then redis.call('HSETNX', KEYS[1], 'run', ARGV[4]) end
if ARGV[5] ~= '' then redis.call('HSETNX', KEYS[1], 'item_key', ARGV[5]) end
redis.call('HSET', KEYS[1], 'last_seen', ARGV[3])
redis.call('PEXPIRE', KEYS[1], $ttl_ms)
local graded = redis.call('HGET', KEYS[1], 'graded') or ''
if string.sub(ARGV[2], 4, 4) ~= '1' then return {'ok', graded} end
redis.call('PEXPIRE', KEYS[2], $ttl_ms)
return {'ok', graded, redis.call('HGETALL', KEYS[2])}
"""

# After the tool returned: apply its writes, record its answer and release the lock, atomically, and
# only while the call still owns its claim and the lock (a stalled worker whose claim or lock lapsed
# must not apply writes after another attempt took over). Flags: ledger, lock. ARGV[3] is the answer,
# then field/value pairs. Returns 1 (applied), 0 (the claim lapsed) or -1 (the lock lapsed).
_FINISH = """
local token = ARGV[1]
local ledger = string.sub(ARGV[2], 1, 1) == '1'
local locked = string.sub(ARGV[2], 2, 2) == '1'
local result = 1
if ledger and redis.call('GET', KEYS[3]) ~= 'P:' .. token then
  result = 0
elseif locked and redis.call('GET', KEYS[4]) ~= token then
  result = -1
end
if result ~= 1 then
  if ledger and redis.call('GET', KEYS[3]) == 'P:' .. token then redis.call('DEL', KEYS[3]) end
  if locked and redis.call('GET', KEYS[4]) == token then redis.call('DEL', KEYS[4]) end
  return result
end
for i = 4, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
if #ARGV >= 4 then redis.call('PEXPIRE', KEYS[2], $ttl_ms) end
redis.call('PEXPIRE', KEYS[1], $ttl_ms)
if ledger then redis.call('SET', KEYS[3], 'A:' .. ARGV[3], 'PX', $ttl_ms) end
if locked then redis.call('DEL', KEYS[4]) end
return 1
"""

# Give up what is still ours. Flags: ledger, lock.
_ABORT = """
if string.sub(ARGV[2], 1, 1) == '1' and redis.call('GET', KEYS[3]) == 'P:' .. ARGV[1] then
  redis.call('DEL', KEYS[3])
end
if string.sub(ARGV[2], 2, 2) == '1' and redis.call('GET', KEYS[4]) == ARGV[1] then
  redis.call('DEL', KEYS[4])
end
return 1
"""

# Keep long calls' claims and locks alive, only while they are still theirs. Flags: ledger, lock.
_EXTEND = """
local kept = 0
if string.sub(ARGV[2], 1, 1) == '1' and redis.call('GET', KEYS[3]) == 'P:' .. ARGV[1] then
  redis.call('PEXPIRE', KEYS[3], $claim_ms)
  kept = kept + 1
end
if string.sub(ARGV[2], 2, 2) == '1' and redis.call('GET', KEYS[4]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[4], $lock_ms)
  kept = kept + 1
end
return kept
"""


_FLAG_CHARS = ("0", "1")


def _flags(*switches: bool) -> str:
    return "".join(map(_FLAG_CHARS.__getitem__, switches))


class _Script:
    """A Lua script run by EVALSHA, loaded again if the server lost it (restarted, SCRIPT FLUSH).

    The client's own Script helper goes through argument-checking wrappers that cost more than the
    round trip itself on this hot path; this sends the same EVALSHA through execute_command.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()  # the name Redis gives the script

    async def __call__(self, client: Redis, keys: list[str], args: list[Any]) -> Any:
        run: Any = client.execute_command
        try:
            return await run("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await run("SCRIPT LOAD", self.source)
            return await run("EVALSHA", self.sha, len(keys), *keys, *args)


_Queued = tuple[_Script, list[str], list[Any], "asyncio.Future[Any]"]


class _ScriptBatcher:
    """Sends the scripts that concurrent calls run in one turn of the event loop as one pipeline.

    Under load many calls reach Redis at once; one pipeline takes one connection and one write for
    all of them, instead of a checkout, a write and a retry wrapper each. Every script here is safe
    to send twice (it recognizes its own token), so sending a pipeline again after a dropped
    connection cannot apply a call twice.

    A connection that served a pipeline well is kept for the next one rather than handed back to
    the pool (whose checkout, with its lock, deadline and bookkeeping, cost more than a pipeline's
    own client work): at most a quarter of the pool, and never more than four, so the pool's other
    users always find connections. One that failed goes back to the pool, dropped.
    """

    def __init__(self, client: Redis, op_timeout: float) -> None:
        self._client = client
        self._op_timeout = op_timeout
        self._queue: list[_Queued] = []
        self._sending: set[asyncio.Task[None]] = set()
        self._kept: list[Any] = []
        pool_size = getattr(client.connection_pool, "max_connections", 0) or 0
        self._keep = max(0, min(4, pool_size // 4))

    def run(self, script: _Script, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._queue:
            # The task's first step runs in the loop's next turn, after every call of this turn queued.
            task = loop.create_task(self._send_queued())
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        self._queue.append((script, keys, args, future))
        return future

    async def _send_queued(self) -> None:
        batch, self._queue = self._queue, []
        await self._send(batch)

    async def _one(self, script: _Script, keys: list[str], args: list[Any]) -> Any:
        async with asyncio.timeout(self._op_timeout):
            return await script(self._client, keys, args)

    async def _send(self, batch: list[_Queued]) -> None:
        # One deadline for the whole batch: a hung Redis fails every call in it with TimeoutError.
        commands = [("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args, _ in batch]
        try:
            async with asyncio.timeout(self._op_timeout):
                results = await self._pipeline(commands)
        except BaseException as exc:
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for (script, keys, args, future), result in zip(batch, results, strict=True):
            if future.done():
                continue  # the caller gave up (its deadline passed)
            if isinstance(result, NoScriptError):
                # Redis lost its scripts (restarted, flushed): this one loads it and runs again.
                retry = asyncio.get_running_loop().create_task(self._one(script, keys, args))
                retry.add_done_callback(functools.partial(_settle_from, future))
                self._sending.add(retry)
                retry.add_done_callback(self._sending.discard)
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _pipeline(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send the commands in one write on one pooled connection and read their replies in order.

        What the client's pipeline does for commands without a transaction, without its per-command
        layers (option handling, reply callbacks, command bookkeeping), which on this path cost more
        than the replies. A script's error reply is returned in its place, like
        `execute(raise_on_error=False)`; any other failure leaves the connection out of step with
        its replies, so the connection is dropped before it goes back to the pool.
        """
        pool = self._client.connection_pool
        if self._kept:
            connection = self._kept.pop()
        else:
            connection = await pool.get_connection()  # type: ignore[no-untyped-call]
        served = False
        try:
            try:
                results = await self._exchange(connection, commands)
            except (ConnectionError, RedisTimeoutError):
                # The connection was dead (Redis restarted, a proxy closed it while idle): the same
                # scripts once more, on a new one. Each is safe to run twice.
                results = await self._exchange(connection, commands)
            served = True
            return results
        finally:
            if served and len(self._kept) < self._keep:
                self._kept.append(connection)
            else:
                await pool.release(connection)

    @staticmethod
    async def _exchange(connection: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        try:
            await connection.send_packed_command(connection.pack_commands(commands))
            results: list[Any] = []
            for _ in commands:
                try:
                    results.append(await connection.read_response())
                except ResponseError as exc:
                    results.append(exc)
            return results
        except BaseException:
            await connection.disconnect(nowait=True)
            raise

    async def aclose(self) -> None:
        """Stop sending, and give the kept connections back to the pool."""
        for task in self._sending:
            task.cancel()
        kept, self._kept = self._kept, []
        for connection in kept:
            await self._client.connection_pool.release(connection)


def _settle_from(future: asyncio.Future[Any], task: asyncio.Task[Any]) -> None:
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        future.set_result(task.result())


def _prefix(trace_id: str) -> str:
    # The hash tag keeps every key of a rollout in one Redis Cluster slot (atomic scripts need it).
    return f"sp:{{{trace_id}}}"


def _keys(trace_id: str, call_id: str | None) -> list[str]:
    prefix = _prefix(trace_id)
    # Without a call_id the ledger key is never read or written; it is named for the fixed layout only.
    return [f"{prefix}:meta", f"{prefix}:state", f"{prefix}:call:{call_id or ''}", f"{prefix}:lock"]


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
        client: Redis,
        *,
        ttl_seconds: float,
        lock_timeout: float,
        claim_timeout: float,
        lock_wait: float,
        op_timeout: float = 5.0,
    ) -> None:
        self._redis = client
        self._lock_wait = lock_wait
        self._ttl_ms = int(ttl_seconds * 1000)
        self._lock_ms = int(lock_timeout * 1000)
        self._claim_ms = int(claim_timeout * 1000)
        self._op_timeout = op_timeout
        expiries = {"claim_ms": self._claim_ms, "lock_ms": self._lock_ms, "ttl_ms": self._ttl_ms}
        self._begin, self._finish, self._abort, self._extend = (
            _Script(Template(source).substitute(expiries)) for source in (_BEGIN, _FINISH, _ABORT, _EXTEND)
        )
        self._batcher = _ScriptBatcher(client, op_timeout)
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

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        if isinstance(exc, TimeoutError):
            return StoreUnavailable(f"rollout state store did not answer within {self._op_timeout:g} s")
        return StoreUnavailable(f"rollout state store unreachable: {type(exc).__name__}: {exc}")

    async def _guard(self, operation: Awaitable[T]) -> T:
        """Run one Redis operation under one deadline; an unreachable or hung Redis is a 503."""
        try:
            async with asyncio.timeout(self._op_timeout):
                return await operation
        except (TimeoutError, RedisError, OSError) as exc:
            raise self._unavailable(exc) from exc

    async def _run(self, script: _Script, trace_id: str, call_id: str | None, args: list[Any]) -> Any:
        """Run one of the call scripts, batched with others (the batch carries the deadline)."""
        try:
            return await self._batcher.run(script, _keys(trace_id, call_id), args)
        except (TimeoutError, RedisError, OSError) as exc:
            raise self._unavailable(exc) from exc

    # --- one call: begin, then finish or abort ------------------------------------------------------

    async def begin(
        self,
        trace_id: str,
        call_id: str | None,
        *,
        lock: bool,
        meta: RolloutMeta | None,
        load_changes: bool,
        wait: float,
    ) -> Ticket | StoredAnswer:
        token = f"{self._token_prefix}{next(self._token_count):x}"
        ticket = Ticket(trace_id=trace_id, call_id=call_id, token=token, locked=lock)
        if call_id is None and not lock and meta is None:
            return ticket
        args: list[Any] = [
            ticket.token,
            _flags(call_id is not None, lock, meta is not None, meta is not None and load_changes),
        ]
        if meta is not None:
            args += [repr(meta.now), meta.run or "", meta.item_key or ""]
        now = time.monotonic()
        call_deadline, lock_deadline = now + wait, now + self._lock_wait
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
                        raise StoreUnavailable("timed out waiting for the rollout's lock") from None
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
                return StoredAnswer(output=data["output"], outcome=data["outcome"])
            # Wait and try again: for another attempt of this call to answer (or its claim to lapse),
            # or for the call holding the rollout's lock (in another process) to finish.
            if kind == "busy":
                if time.monotonic() >= call_deadline:
                    raise StoreUnavailable(f"call {ticket.call_id} is still running elsewhere")
                await asyncio.sleep(busy_pause)
                busy_pause = min(busy_pause * 2, 0.1)
            else:
                if time.monotonic() >= lock_deadline:
                    raise StoreUnavailable("timed out waiting for the rollout's lock")
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
                        [ticket.token, _flags(ticket.call_id is not None, ticket.locked)],
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
            _flags(ledger, ticket.locked),
            orjson.dumps({"output": answer.output, "outcome": answer.outcome}) if ledger else "",
        ]
        for pack, collections in writes.items():
            for collection, records in collections.items():
                for key, value in records.items():
                    args.append(_SEP.join((pack, collection, key)))
                    args.append(orjson.dumps(value))
        applied = await self._run(self._finish, ticket.trace_id, ticket.call_id, args)
        if applied == 0:
            raise StoreUnavailable(
                "this call's claim lapsed while it ran; a retry will get the stored answer"
            )
        if applied == -1:
            raise StoreUnavailable(
                "the rollout's lock lapsed while this call ran; nothing was applied, a retry runs it again"
            )

    async def abort(self, ticket: Ticket) -> None:
        try:
            if ticket.call_id is not None or ticket.locked:
                flags = _flags(ticket.call_id is not None, ticket.locked)
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
        self._live.clear()
        if self._keeper is not None:
            self._keeper.cancel()
        await self._batcher.aclose()
        await self._redis.aclose()


def _decode_changes(raw: dict[Any, Any]) -> PackChanges:
    return _decode_items(raw.items())


def _decode_pairs(flat: list[Any]) -> PackChanges:
    """HGETALL's reply inside a script: field, value, field, value, ..."""
    return _decode_items(zip(flat[::2], flat[1::2], strict=True))


def _decode_items(items: Iterable[tuple[Any, Any]]) -> PackChanges:
    changes: PackChanges = {}
    for field_name, value in items:
        pack, collection, key = _text(field_name).split(_SEP, 2)
        changes.setdefault(pack, {}).setdefault(collection, {})[key] = orjson.loads(value)
    return changes
