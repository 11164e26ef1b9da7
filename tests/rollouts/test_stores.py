"""The rollout store interface, exercised directly on the memory store and on real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from app.rollouts.memory import MemoryRolloutStore
from app.rollouts.redis_store import RedisRolloutStore
from app.rollouts.store import Claim, RolloutMeta, RolloutStore, StoredAnswer, StoreUnavailable
from tests.conftest import REDIS_URL, new_trace


def meta() -> RolloutMeta:
    return RolloutMeta(run="r", item_key="id:1", now=time.time())


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RolloutStore]:
    s: RolloutStore
    if request.param == "memory":
        s = MemoryRolloutStore(ttl_seconds=3600)
    else:
        s = RedisRolloutStore(
            Redis.from_url(REDIS_URL), ttl_seconds=3600, lock_timeout=2.0, claim_timeout=1.5, lock_wait=5.0
        )
    yield s
    await s.aclose()


async def test_claim_commit_replay(store: RolloutStore) -> None:
    trace = new_trace()
    claim = await store.claim(trace, "c1", wait=1)
    assert isinstance(claim, Claim)
    answer = StoredAnswer(output='{"ok":true}', outcome="ok")
    await store.commit(trace, {"p": {"things": {"a": {"n": 1}}}}, ("c1", claim, answer))
    assert await store.claim(trace, "c1", wait=1) == answer
    assert (await store.changes(trace)) == {"p": {"things": {"a": {"n": 1}}}}
    snapshot = await store.open(trace, meta(), load_changes=True)
    assert snapshot.changes == {"p": {"things": {"a": {"n": 1}}}} and not snapshot.graded


async def test_duplicate_waits_for_the_running_call(store: RolloutStore) -> None:
    trace = new_trace()
    claim = await store.claim(trace, "c1", wait=1)
    assert isinstance(claim, Claim)
    waiter = asyncio.create_task(store.claim(trace, "c1", wait=5))
    await asyncio.sleep(0.05)
    assert not waiter.done(), "a duplicate must wait while the first attempt runs"
    answer = StoredAnswer(output="first", outcome="ok")
    await store.commit(trace, {}, ("c1", claim, answer))
    assert await asyncio.wait_for(waiter, 5) == answer


async def test_released_claim_lets_the_retry_run(store: RolloutStore) -> None:
    trace = new_trace()
    claim = await store.claim(trace, "c1", wait=1)
    assert isinstance(claim, Claim)
    waiter = asyncio.create_task(store.claim(trace, "c1", wait=5))
    await asyncio.sleep(0.05)
    await store.release(trace, "c1", claim)
    second = await asyncio.wait_for(waiter, 5)
    assert isinstance(second, Claim) and second != claim


async def test_duplicate_gives_up_after_its_wait(store: RolloutStore) -> None:
    trace = new_trace()
    assert isinstance(await store.claim(trace, "c1", wait=1), Claim)
    with pytest.raises(TimeoutError):
        await store.claim(trace, "c1", wait=0.1)


async def test_lock_serializes_one_rollout_not_others(store: RolloutStore) -> None:
    trace, other = new_trace(), new_trace()
    order: list[str] = []

    async def hold(name: str, trace_id: str, seconds: float) -> None:
        async with store.lock(trace_id):
            order.append(f"{name}+")
            await asyncio.sleep(seconds)
            order.append(f"{name}-")

    first = asyncio.create_task(hold("a", trace, 0.2))
    await asyncio.sleep(0.02)
    second = asyncio.create_task(hold("b", trace, 0.0))
    third = asyncio.create_task(hold("c", other, 0.0))
    await asyncio.gather(first, second, third)
    assert order.index("a-") < order.index("b+"), order
    assert order.index("c-") < order.index("a-"), "another rollout must not wait for this one's lock"


async def test_deletes_are_tombstones_and_graded_flag(store: RolloutStore) -> None:
    trace = new_trace()
    await store.commit(trace, {"p": {"things": {"a": {"n": 1}, "b": {"n": 2}}}}, None)
    await store.commit(trace, {"p": {"things": {"a": None}}}, None)
    assert (await store.changes(trace)) == {"p": {"things": {"a": None, "b": {"n": 2}}}}
    assert not await store.is_graded(trace)
    await store.mark_graded(trace)
    assert await store.is_graded(trace)
    assert (await store.open(trace, meta(), load_changes=False)).graded


async def test_rollouts_are_isolated(store: RolloutStore) -> None:
    a, b = new_trace(), new_trace()
    await store.commit(a, {"p": {"things": {"x": {"v": "a"}}}}, None)
    assert await store.changes(b) == {}


async def test_redis_commit_refuses_a_lapsed_claim() -> None:
    store = RedisRolloutStore(
        Redis.from_url(REDIS_URL), ttl_seconds=3600, lock_timeout=2.0, claim_timeout=1.5, lock_wait=5.0
    )
    try:
        trace = new_trace()
        claim = await store.claim(trace, "c1", wait=1)
        assert isinstance(claim, Claim)
        # Simulate a stalled worker whose claim expired and was taken over by a retry.
        await store.release(trace, "c1", claim)
        retry = await store.claim(trace, "c1", wait=1)
        assert isinstance(retry, Claim)
        with pytest.raises(StoreUnavailable):
            await store.commit(trace, {"p": {"t": {"k": 1}}}, ("c1", claim, StoredAnswer("stale", "ok")))
        assert await store.changes(trace) == {}, "a stale claim's writes must not be applied"
    finally:
        await store.aclose()


async def test_redis_claim_of_a_crashed_worker_lapses() -> None:
    client = Redis.from_url(REDIS_URL)
    store = RedisRolloutStore(client, ttl_seconds=3600, lock_timeout=2.0, claim_timeout=0.3, lock_wait=5.0)
    try:
        trace = new_trace()
        # A claim written by a worker that died (no keepalive runs for it).
        await client.set(f"sp:{{{trace}}}:call:c1", "P:deadbeef", px=300)
        again = await store.claim(trace, "c1", wait=3)
        assert isinstance(again, Claim)
        await store.release(trace, "c1", again)
    finally:
        await store.aclose()


async def test_redis_down_is_store_unavailable() -> None:
    store = RedisRolloutStore(
        Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2),
        ttl_seconds=60,
        lock_timeout=1,
        claim_timeout=1,
        lock_wait=1,
    )
    try:
        with pytest.raises(StoreUnavailable) as info:
            await store.open(new_trace(), meta(), load_changes=True)
        assert info.value.status_code == 503
    finally:
        await store.aclose()
