"""Commands packed by hiredis are byte for byte what redis-py's own packer sends, and they work."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import BlockingConnectionPool, Connection, Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import DataError

from app.rollouts.redis_packing import HiredisPacking, use_hiredis_packing, use_hiredis_packing_on_cluster
from tests.conftest import REDIS_URL
from tests.redis_cluster import LocalCluster

COMMANDS: list[tuple[Any, ...]] = [
    ("GET", "key"),
    ("SET", b"bin\x00ary", "vålue 🙂", "PX", 1500),
    ("SCRIPT LOAD", "return 1"),  # a command name of two words
    ("EVALSHA", "a" * 40, 2, "k1", "k2", 1.5, -3, b"", ""),
    ("SET", "k", bytearray(b"ba"), memoryview(b"mv")),
    ("HSET", "h", "f", "x" * 10_000),  # longer than redis-py's buffer cutoff
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: str(c[0]))
def test_hiredis_packs_like_redis_py(command: tuple[Any, ...]) -> None:
    plain = Connection()
    packed = type("Packed", (HiredisPacking, Connection), {})()
    assert b"".join(packed.pack_command(*command)) == b"".join(plain.pack_command(*command))
    assert b"".join(packed.pack_commands(COMMANDS)) == b"".join(plain.pack_commands(COMMANDS))


def test_an_argument_redis_cannot_take_is_a_data_error() -> None:
    packed = type("Packed", (HiredisPacking, Connection), {})()
    with pytest.raises(DataError):
        packed.pack_command("SET", "k", None)


async def test_a_client_on_a_packing_pool_talks_to_redis() -> None:
    pool = BlockingConnectionPool.from_url(REDIS_URL)
    use_hiredis_packing(pool)
    use_hiredis_packing(pool)  # twice changes nothing
    assert pool.connection_class.__mro__[1:3] == (HiredisPacking, Connection)
    client = Redis(connection_pool=pool)
    try:
        await client.set("sparring-test:packing", "vålue 🙂", px=5000)
        assert (await client.get("sparring-test:packing")).decode() == "vålue 🙂"
        pipe = client.pipeline(transaction=True)
        pipe.incr("sparring-test:packing-n").expire("sparring-test:packing-n", 5)
        assert (await pipe.execute())[0] >= 1
        assert await client.eval("return ARGV[1]", 0, "échö") == "échö".encode()
    finally:
        await client.delete("sparring-test:packing", "sparring-test:packing-n")
        await client.aclose()


async def test_a_cluster_client_packs_with_hiredis_on_every_node(redis_cluster: LocalCluster) -> None:
    client = RedisCluster.from_url(redis_cluster.url)
    use_hiredis_packing_on_cluster(client)
    use_hiredis_packing_on_cluster(client)  # twice changes nothing
    try:
        keys = [f"sparring-test:packing:{n}" for n in range(20)]  # spread over the shards
        for key in keys:
            await client.set(key, "vålue 🙂", px=5000)
        values = [await client.get(key) for key in keys]
        assert values == ["vålue 🙂".encode()] * len(keys)
        nodes = client.get_nodes()
        assert len(nodes) == 3
        for node in nodes:
            assert node.connection_class.__mro__[1:3] == (HiredisPacking, Connection)
            assert all(isinstance(c, HiredisPacking) for c in node._connections)
    finally:
        await client.delete(*keys)
        await client.aclose()
