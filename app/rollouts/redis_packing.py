"""Redis commands packed by hiredis's C packer, on the asyncio client too.

redis-py's synchronous connections pack commands with `hiredis.pack_command` when hiredis is
installed; its asyncio connections always pack them in Python, which on the tool-call path cost more
CPU than parsing the replies. `use_hiredis_packing` gives a pool's connections the C packer, whatever
connection class the URL chose (TCP, TLS, Unix socket).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import hiredis  # installed with redis[hiredis]
from redis.asyncio import ConnectionPool
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import DataError


def _split_name(args: tuple[Any, ...]) -> tuple[Any, ...]:
    # As redis-py does: a command name of several words ('SCRIPT LOAD') is sent as separate words.
    first = args[0]
    if isinstance(first, str):
        return (*first.split(), *args[1:]) if " " in first else args
    return (*first.split(), *args[1:]) if b" " in first else args


def _pack(args: tuple[Any, ...]) -> bytes:
    args = _split_name(args)
    packed: bytes
    try:
        packed = hiredis.pack_command(args)
        return packed
    except TypeError:
        pass
    # hiredis takes str, bytes, int and float; redis-py also sends bytearrays and memoryviews.
    converted: Any = tuple(bytes(arg) if isinstance(arg, (bytearray, memoryview)) else arg for arg in args)
    try:
        packed = hiredis.pack_command(converted)
        return packed
    except TypeError as exc:  # an argument of a type Redis cannot take (None, a dict, ...)
        raise DataError(str(exc)) from exc


class HiredisPacking:
    """Mixed in before a redis.asyncio connection class."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return [_pack(args)]

    def pack_commands(self, commands: Iterable[Iterable[Any]]) -> list[bytes]:
        # One call per command, not a method call with its arguments unpacked and a list around it.
        return [b"".join([_pack(tuple(command)) for command in commands])]


def use_hiredis_packing(pool: ConnectionPool) -> None:
    """Make the connections the pool opens from now on pack their commands with hiredis."""
    base = pool.connection_class
    if not issubclass(base, HiredisPacking):
        pool.connection_class = type(f"HiredisPacked{base.__name__}", (HiredisPacking, base), {})


def use_hiredis_packing_on_cluster(client: RedisCluster) -> None:
    """The same for a cluster client: the nodes it knows now and those it discovers later (each node
    makes its connections from the client's connection settings)."""
    base = client.connection_kwargs["connection_class"]
    if not issubclass(base, HiredisPacking):
        packed = type(f"HiredisPacked{base.__name__}", (HiredisPacking, base), {})
        client.connection_kwargs["connection_class"] = packed
        for node in client.startup_nodes:
            node.connection_class = packed
