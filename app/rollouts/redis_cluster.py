"""The rollout store on a Redis Cluster: the scripts of one turn, sent to each shard as one pipeline.

Every key of a rollout carries the rollout's hash tag (`<prefix>:{<trace id>}:...`), so each script
touches one slot, and a shard holds whole rollouts. A batch of scripts from many rollouts is grouped by
the node that holds each one's slot and sent to the nodes in parallel; a node that fails fails only the
calls of its own rollouts, which get 503 while the others go on.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from app.rollouts.redis_scripts import BatcherBase, Queued, Script, exchange

_Group = tuple[ClusterNode, list[Queued]]


class ClusterScriptBatcher(BatcherBase):
    """One pipeline per node per turn, the nodes in parallel, each under the batch's deadline.

    A reply that says the slot is elsewhere (MOVED, ASK: a reshard), that the cluster is changing
    (TRYAGAIN, CLUSTERDOWN) or that the node lost its scripts sends that script once more on its own
    through the cluster client, which updates its slot map and follows the redirection; so does a
    node whose connection failed (the client reads the slot map again: a replica may have taken over).
    Every script is safe to send twice, so none of this can apply a call twice.
    """

    _ALONE = (NoScriptError, MovedError, AskError, TryAgainError, ClusterDownError)

    def __init__(self, client: RedisCluster, op_timeout: float) -> None:
        super().__init__(client, op_timeout)
        self._cluster = client
        # A node's pool refuses a connection past its size rather than waiting for one: half of it is for
        # the pipelines, the other half for the store's other commands (`direct`), so neither runs out.
        size = int(client.get_connection_kwargs().get("max_connections") or 2)
        self._half = max(1, size // 2)
        self._pipelines: dict[str, asyncio.Semaphore] = {}
        self._direct = asyncio.Semaphore(self._half)

    def direct(self) -> AbstractAsyncContextManager[Any]:
        return self._direct

    async def _one(
        self, script: Script, keys: list[str], args: list[Any], reason: BaseException | None = None
    ) -> Any:
        async with self._direct:
            if isinstance(reason, AskError):
                return await self._asked(script, keys, args, reason)
            return await super()._one(script, keys, args, reason)

    async def _asked(self, script: Script, keys: list[str], args: list[Any], ask: AskError) -> Any:
        """A slot being moved (ASK): the script on the importing node, after ASKING on the same
        connection (the client's own ASK handling may send the two on different connections).

        A script that names keys the node has not received yet is told TRYAGAIN: it tries again until
        the move is done or its deadline passes (a 503, like any unanswered call).
        """
        node = self._cluster.nodes_manager.get_node(host=ask.host, port=ask.port)
        if node is None:  # a node the slot map does not know yet: the client learns it
            return await super()._one(script, keys, args)
        async with asyncio.timeout(self._op_timeout):
            command: tuple[Any, ...] = ("EVALSHA", script.sha)
            while True:
                _, reply = await _pipeline_on(node, [("ASKING",), (*command, len(keys), *keys, *args)])
                if isinstance(reply, NoScriptError):
                    command = ("EVAL", script.source)  # which loads the script the node lacked
                elif isinstance(reply, TryAgainError):
                    await asyncio.sleep(0.02)
                elif isinstance(reply, (AskError, MovedError)):
                    return await super()._one(script, keys, args)
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    return reply

    async def _send(self, batch: list[Queued]) -> None:
        try:
            async with asyncio.timeout(self._op_timeout):
                groups = await self._by_node(batch)
        except BaseException as exc:  # the slot map cannot be read: no node answers
            self._fail(batch, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        await asyncio.gather(*(self._send_to(node, group) for node, group in groups))

    async def _by_node(self, batch: list[Queued]) -> list[_Group]:
        await self._cluster.initialize()  # reads the slot map only when the client asked for it again
        manager = self._cluster.nodes_manager
        groups: dict[str, _Group] = {}
        for queued in batch:
            try:
                node = manager.get_node_from_slot(self._cluster.keyslot(queued[1][0]))
            except SlotNotCoveredError as exc:
                self._fail([queued], exc)
                continue
            groups.setdefault(node.name, (node, []))[1].append(queued)
        return list(groups.values())

    async def _send_to(self, node: ClusterNode, group: list[Queued]) -> None:
        commands = [("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args, _ in group]
        try:
            async with asyncio.timeout(self._op_timeout):
                limit = self._pipelines.get(node.name) or self._pipelines.setdefault(
                    node.name, asyncio.Semaphore(self._half)
                )
                async with limit:
                    results = await _pipeline_on(node, commands)
        except TimeoutError as exc:  # the batch's deadline passed (an OSError, but not a broken connection)
            self._fail(group, exc)
            return
        except (RedisConnectionError, OSError):
            # The node is down or its connection broke: each call once more through the client.
            for script, keys, args, future in group:
                if not future.done():
                    self._retry_alone(script, keys, args, future)
            return
        except BaseException as exc:  # it did not answer in time (paused, overloaded): 503 for these
            self._fail(group, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self._settle(group, results)


async def _pipeline_on(node: ClusterNode, commands: list[tuple[Any, ...]]) -> list[Any]:
    connection = node.acquire_connection()
    try:
        await node.disconnect_if_needed(connection)  # the client marks connections stale on a new slot map
        return await exchange(connection, commands)
    finally:
        node.release(connection)
