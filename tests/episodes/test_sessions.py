"""Episode session records in the state store: memory, real Redis and a Redis Cluster, through one
interface."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from app.episodes.sessions import SessionStore
from app.rollouts.memory import MemoryRolloutStore
from app.rollouts.redis_store import RedisRolloutStore
from app.rollouts.store import RolloutStore
from tests.conftest import REDIS_KEY_PREFIX, REDIS_URL

ROW = {"task_id": "7", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RolloutStore]:
    s: RolloutStore
    if request.param == "memory":
        s = MemoryRolloutStore(ttl_seconds=3600)
    else:
        client: Redis | RedisCluster = Redis.from_url(REDIS_URL)
        if request.param == "cluster":  # a local three-shard Redis Cluster (tests/redis_cluster.py)
            client = RedisCluster.from_url(request.getfixturevalue("redis_cluster").url)
        s = RedisRolloutStore(
            client,
            key_prefix=REDIS_KEY_PREFIX,
            ttl_seconds=3600,
            lock_timeout=2,
            claim_timeout=2,
            lock_wait=5,
        )
    yield s
    await s.aclose()


def trace() -> str:
    return f"trace_test_{uuid.uuid4().hex}"


async def test_a_session_reads_back_as_written_and_ends(store: RolloutStore) -> None:
    sessions = SessionStore(store, ttl_seconds=60)
    made = await sessions.create(pack="retail", trace_id=trace(), row=ROW, channel="ors", run="r1")
    assert made is not None and uuid.UUID(made.sid).version == 4
    read = await sessions.get(made.sid)
    assert read == made
    assert read.row == ROW and read.done is False and read.reward is None and read.step_count == 0

    await sessions.count_step(read)
    await sessions.count_step(read)
    assert read.step_count == 2 and (await sessions.get(made.sid)).step_count == 2  # type: ignore[union-attr]

    await sessions.finish(read, 0.5)
    ended = await sessions.get(made.sid)
    assert ended is not None and ended.done and ended.reward == 0.5 and ended.step_count == 2

    assert await sessions.close(made.sid) is True
    assert await sessions.get(made.sid) is None
    assert await sessions.close(made.sid) is False
    # A closed session is never brought back by a late writer.
    assert await sessions.save(read) is False
    await sessions.count_step(read)
    assert await sessions.get(made.sid) is None


async def test_a_session_id_is_made_once(store: RolloutStore) -> None:
    sessions = SessionStore(store, ttl_seconds=60)
    sid = str(uuid.uuid4())
    first = await sessions.create(pack="retail", trace_id=trace(), row=None, channel="ors", run="", sid=sid)
    assert first is not None
    again = await sessions.create(pack="retail", trace_id=trace(), row=None, channel="ors", run="", sid=sid)
    assert again is None
    assert (await sessions.get(sid)).trace_id == first.trace_id  # type: ignore[union-attr]


async def test_a_session_without_a_task_is_given_one_once(store: RolloutStore) -> None:
    sessions = SessionStore(store, ttl_seconds=60)
    opened = await sessions.create(pack="", trace_id=trace(), row=None, channel="ors", run="ors")
    assert opened is not None and not opened.started
    assert (await sessions.get(opened.sid)).started is False  # type: ignore[union-attr]
    opened.pack, opened.row = "retail", ROW
    assert await sessions.start(opened) is True
    assert await sessions.start(opened) is False
    read = await sessions.get(opened.sid)
    assert read is not None and read.started and read.row == ROW and read.pack == "retail"


async def test_concurrent_submits_claim_once_and_an_outage_releases(store: RolloutStore) -> None:
    sessions = SessionStore(store, ttl_seconds=60)
    made = await sessions.create(pack="retail", trace_id=trace(), row=ROW, channel="ors", run="")
    assert made is not None
    claims = await asyncio.gather(*(sessions.claim_submit(made, call_id=f"c{n}") for n in range(8)))
    assert sorted(claims) == [False] * 7 + [True]
    winner = f"c{claims.index(True)}"
    assert (await sessions.get(made.sid)).submit_call_id == winner  # type: ignore[union-attr]
    assert await sessions.claim_submit(made) is False
    await sessions.release_submit(made)  # the winner's outage; a refused claim gave back what it took
    assert await sessions.claim_submit(made) is True


async def test_unknown_and_oversized_ids_name_no_session(store: RolloutStore) -> None:
    sessions = SessionStore(store, ttl_seconds=60)
    assert await sessions.get(str(uuid.uuid4())) is None
    assert await sessions.get("") is None
    assert await sessions.get("x" * 500) is None
    assert await sessions.close("x" * 500) is False


async def test_an_idle_session_expires(store: RolloutStore) -> None:
    sessions = SessionStore(store, ttl_seconds=0.2)
    made = await sessions.create(pack="retail", trace_id=trace(), row=None, channel="ors", run="")
    assert made is not None
    await asyncio.sleep(0.5)
    assert await sessions.get(made.sid) is None


async def test_a_session_record_lives_under_the_stores_key_prefix() -> None:
    """Session records, like rollouts, are under the configured prefix: a run's cleanup finds them, and
    two deployments sharing a Redis with different prefixes never see each other's sessions."""
    client = Redis.from_url(REDIS_URL)
    timeouts = {"ttl_seconds": 60, "lock_timeout": 2, "claim_timeout": 2, "lock_wait": 5}
    mine = RedisRolloutStore(client, key_prefix=REDIS_KEY_PREFIX, **timeouts)
    other = RedisRolloutStore(Redis.from_url(REDIS_URL), key_prefix=f"{REDIS_KEY_PREFIX}x", **timeouts)
    try:
        made = await SessionStore(mine, ttl_seconds=60).create(
            pack="retail", trace_id=trace(), row=None, channel="ors", run=""
        )
        assert made is not None
        keys = [key.decode() async for key in client.scan_iter(match=f"*rec:*{made.sid}*")]
        assert keys and all(key.startswith(f"{REDIS_KEY_PREFIX}:rec:") for key in keys), keys
        assert await SessionStore(other, ttl_seconds=60).get(made.sid) is None
    finally:
        await mine.aclose()
        await other.aclose()
