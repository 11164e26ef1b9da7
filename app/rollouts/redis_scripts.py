"""The Redis side of the rollout store: its four Lua scripts, and the batcher that pipelines them.

The scripts that concurrent calls send in one event-loop turn go to Redis as one pipeline, written and
read directly on a connection of the pool; each script is safe to send twice, so a pipeline that met a
dropped connection goes once more on a new one (app/rollouts/redis_store.py uses them).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
from contextlib import AbstractAsyncContextManager
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

SEP = "\x1f"
PENDING = "P:"
ANSWERED = "A:"

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
BEGIN = """
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
FINISH = """
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
ABORT = """
if string.sub(ARGV[2], 1, 1) == '1' and redis.call('GET', KEYS[3]) == 'P:' .. ARGV[1] then
  redis.call('DEL', KEYS[3])
end
if string.sub(ARGV[2], 2, 2) == '1' and redis.call('GET', KEYS[4]) == ARGV[1] then
  redis.call('DEL', KEYS[4])
end
return 1
"""

# Keep long calls' claims and locks alive, only while they are still theirs. Flags: ledger, lock.
EXTEND = """
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

# What a connection that was reset raises when used: the client's errors, or the event loop's own
# (uvloop raises RuntimeError writing to a closed transport, asyncio an OSError).
_DEAD_CONNECTION = (ConnectionError, RedisTimeoutError, OSError, RuntimeError)


def script_flags(*switches: bool) -> str:
    return "".join(map(_FLAG_CHARS.__getitem__, switches))


class Script:
    """A Lua script run by EVALSHA, loaded again if the server lost it (restarted, SCRIPT FLUSH).

    The client's own Script helper goes through argument-checking wrappers that cost more than the
    round trip itself on this hot path; this sends the same EVALSHA through execute_command.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()  # the name Redis gives the script

    async def __call__(self, client: Redis | RedisCluster, keys: list[str], args: list[Any]) -> Any:
        run: Any = client.execute_command
        try:
            return await run("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            # EVAL runs the source and loads it, on the one server (or cluster node) that holds the keys.
            return await run("EVAL", self.source, len(keys), *keys, *args)


Queued = tuple[Script, list[str], list[Any], "asyncio.Future[Any]"]


class BatcherBase:
    """Queues the scripts that calls run in one turn of the event loop; `_send` sends each turn's batch."""

    def __init__(self, client: Redis | RedisCluster, op_timeout: float) -> None:
        self._target = client
        self._op_timeout = op_timeout
        self._queue: list[Queued] = []
        self._sending: set[asyncio.Task[None]] = set()

    def run(self, script: Script, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
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

    async def _send(self, batch: list[Queued]) -> None:
        raise NotImplementedError

    def direct(self) -> AbstractAsyncContextManager[Any]:
        """Held around each of the store's commands that go past the batcher (none needed on one Redis,
        whose pool waits for a free connection)."""
        return contextlib.nullcontext()

    async def _one(
        self, script: Script, keys: list[str], args: list[Any], reason: BaseException | None = None
    ) -> Any:
        """The script once more on its own (`reason`: the reply or failure that sent it here)."""
        async with asyncio.timeout(self._op_timeout):
            return await script(self._target, keys, args)

    # Replies after which a script is sent once more on its own, through the client (which loads it,
    # or follows the cluster to the node that holds its keys): Redis lost its scripts (restarted,
    # flushed).
    _ALONE: tuple[type[Exception], ...] = (NoScriptError,)

    def _settle(self, batch: list[Queued], results: list[Any]) -> None:
        for (script, keys, args, future), result in zip(batch, results, strict=True):
            if future.done():
                continue  # the caller gave up (its deadline passed)
            if isinstance(result, self._ALONE):
                self._retry_alone(script, keys, args, future, result)
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def _retry_alone(
        self,
        script: Script,
        keys: list[str],
        args: list[Any],
        future: asyncio.Future[Any],
        reason: BaseException | None = None,
    ) -> None:
        retry = asyncio.get_running_loop().create_task(self._one(script, keys, args, reason))
        retry.add_done_callback(functools.partial(_settle_from, future))
        self._sending.add(retry)
        retry.add_done_callback(self._sending.discard)

    @staticmethod
    def _fail(batch: list[Queued], exc: BaseException) -> None:
        for *_, future in batch:
            if not future.done():
                future.set_exception(exc)

    async def aclose(self) -> None:
        """Stop sending."""
        for task in self._sending:
            task.cancel()


class ScriptBatcher(BatcherBase):
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
        super().__init__(client, op_timeout)
        self._client = client
        self._kept: list[Any] = []
        pool_size = getattr(client.connection_pool, "max_connections", 0) or 0
        self._keep = max(0, min(4, pool_size // 4))

    async def _send(self, batch: list[Queued]) -> None:
        # One deadline for the whole batch: a hung Redis fails every call in it with TimeoutError.
        commands = [("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args, _ in batch]
        try:
            async with asyncio.timeout(self._op_timeout):
                results = await self._pipeline(commands)
        except BaseException as exc:
            self._fail(batch, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self._settle(batch, results)

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
                results = await exchange(connection, commands)
            except _DEAD_CONNECTION:
                # The connection was dead (Redis restarted, a proxy closed it while idle): the same
                # scripts once more, on a new one. Each is safe to run twice.
                results = await exchange(connection, commands)
            served = True
            return results
        finally:
            if served and len(self._kept) < self._keep:
                self._kept.append(connection)
            else:
                await pool.release(connection)

    async def aclose(self) -> None:
        """Stop sending, and give the kept connections back to the pool."""
        await super().aclose()
        kept, self._kept = self._kept, []
        for connection in kept:
            await self._client.connection_pool.release(connection)


async def exchange(connection: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Write the commands at once on the connection and read their replies in order; a command's error
    reply stands in its place. Any other failure drops the connection (it is out of step)."""
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


def _settle_from(future: asyncio.Future[Any], task: asyncio.Task[Any]) -> None:
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif task.exception() is not None:
        future.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        future.set_result(task.result())
