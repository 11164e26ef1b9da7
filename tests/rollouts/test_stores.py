"""The rollout store interface, exercised directly on the memory store and on real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from app.rollouts.build import build_store
from app.rollouts.memory import MemoryRolloutStore
from app.rollouts.redis_store import RedisRolloutStore
from app.rollouts.store import (
    CallStart,
    PackChanges,
    RolloutMeta,
    RolloutStore,
    StoredAnswer,
    StoreUnavailable,
    Ticket,
)
from tests.conftest import REDIS_KEY_PREFIX, REDIS_URL, make_settings, new_trace
from tests.redis_cluster import LocalCluster

ANSWER = StoredAnswer(output='{"ok":true}', outcome="ok")


def meta() -> RolloutMeta:
    return RolloutMeta(run="r", item_key="id:1", now=time.time())


def redis_client(cluster: LocalCluster | None = None) -> Redis | RedisCluster:
    """A client of the test Redis, or of the local cluster when one is given."""
    return RedisCluster.from_url(cluster.url) if cluster is not None else Redis.from_url(REDIS_URL)


def redis_store(
    *,
    # Long enough that a stall of a loaded CI machine never lapses a claim or lock the keep-alive
    # holds; the tests of expiry pass their own short ones.
    claim_timeout: float = 15.0,
    lock_timeout: float = 15.0,
    lock_wait: float = 5.0,
    cluster: LocalCluster | None = None,
) -> RedisRolloutStore:
    return RedisRolloutStore(
        redis_client(cluster),
        key_prefix=REDIS_KEY_PREFIX,
        ttl_seconds=3600,
        lock_timeout=lock_timeout,
        claim_timeout=claim_timeout,
        lock_wait=lock_wait,
    )


@pytest.fixture(params=["redis", "cluster"])
def cluster(request: pytest.FixtureRequest) -> LocalCluster | None:
    """None for the test Redis, or the local Redis Cluster: the tests that take it run on both."""
    return request.getfixturevalue("redis_cluster") if request.param == "cluster" else None


@asynccontextmanager
async def redis_store_and_client(
    cluster: LocalCluster | None = None, **settings: float
) -> AsyncIterator[tuple[RedisRolloutStore, Any]]:
    """A Redis store and a plain client on the same database (or cluster), to look at the keys it writes."""
    store, client = redis_store(cluster=cluster, **settings), redis_client(cluster)
    try:
        yield store, client
    finally:
        await client.aclose()
        await store.aclose()


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RolloutStore]:
    s: RolloutStore
    if request.param == "memory":
        s = MemoryRolloutStore(ttl_seconds=3600, lock_wait=5.0)
    elif request.param == "cluster":  # a local three-shard Redis Cluster (tests/redis_cluster.py)
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        s = redis_store(cluster=cluster)
    else:
        s = redis_store()
    yield s
    await s.aclose()


async def begin(
    store: RolloutStore,
    trace: str,
    call_id: str | None,
    *,
    lock: bool = False,
    load: bool = True,
    wait: float = 1.0,
) -> Ticket | StoredAnswer:
    return await store.begin(CallStart(trace, call_id, lock=lock, meta=meta(), load_changes=load, wait=wait))


async def ticket(store: RolloutStore, trace: str, call_id: str | None, *, lock: bool = False) -> Ticket:
    began = await begin(store, trace, call_id, lock=lock)
    assert isinstance(began, Ticket), began
    return began


async def write(store: RolloutStore, trace: str, writes: PackChanges) -> None:
    """A state-changing call without a call_id: under the lock, not deduplicated."""
    await store.finish(await ticket(store, trace, None, lock=True), writes, ANSWER)


async def test_begin_finish_replay(store: RolloutStore) -> None:
    trace = new_trace()
    first = await ticket(store, trace, "c1", lock=True)
    assert first.changes == {} and not first.graded
    await store.finish(first, {"p": {"things": {"a": {"n": 1}}}}, ANSWER)
    assert await begin(store, trace, "c1", lock=True) == ANSWER, "a retry gets the stored answer"
    assert (await store.changes(trace)) == {"p": {"things": {"a": {"n": 1}}}}
    reader = await ticket(store, trace, None)
    assert reader.changes == {"p": {"things": {"a": {"n": 1}}}} and not reader.graded


async def test_begin_without_load_reads_no_changes(store: RolloutStore) -> None:
    trace = new_trace()
    await write(store, trace, {"p": {"things": {"a": {"n": 1}}}})
    began = await begin(store, trace, None, load=False)
    assert isinstance(began, Ticket) and began.changes == {}


async def test_duplicate_waits_for_the_running_call(store: RolloutStore) -> None:
    trace = new_trace()
    first = await ticket(store, trace, "c1", lock=True)
    waiter = asyncio.create_task(begin(store, trace, "c1", lock=True, wait=5))
    await asyncio.sleep(0.05)
    assert not waiter.done(), "a duplicate must wait while the first attempt runs"
    answer = StoredAnswer(output="first", outcome="ok")
    await store.finish(first, {}, answer)
    assert await asyncio.wait_for(waiter, 5) == answer


async def test_aborted_call_lets_the_retry_run(store: RolloutStore) -> None:
    trace = new_trace()
    first = await ticket(store, trace, "c1", lock=True)
    waiter = asyncio.create_task(begin(store, trace, "c1", lock=True, wait=5))
    await asyncio.sleep(0.05)
    await store.abort(first)
    second = await asyncio.wait_for(waiter, 5)
    assert isinstance(second, Ticket) and second.token != first.token
    await store.finish(second, {"p": {"t": {"k": 2}}}, ANSWER)
    assert await store.changes(trace) == {"p": {"t": {"k": 2}}}


async def test_duplicate_gives_up_after_its_wait(store: RolloutStore) -> None:
    trace = new_trace()
    await ticket(store, trace, "c1")
    with pytest.raises(StoreUnavailable, match="still running"):
        await begin(store, trace, "c1", wait=0.1)


async def test_lock_serializes_one_rollout_not_others(store: RolloutStore) -> None:
    trace, other = new_trace(), new_trace()
    order: list[str] = []

    async def hold(name: str, trace_id: str, seconds: float) -> None:
        held = await ticket(store, trace_id, name, lock=True)
        order.append(f"{name}+")
        await asyncio.sleep(seconds)
        order.append(f"{name}-")
        await store.finish(held, {}, ANSWER)

    first = asyncio.create_task(hold("a", trace, 0.2))
    await asyncio.sleep(0.02)
    second = asyncio.create_task(hold("b", trace, 0.0))
    third = asyncio.create_task(hold("c", other, 0.0))
    reader = asyncio.create_task(ticket(store, trace, "r"))  # no lock: never waits for one
    await asyncio.wait_for(reader, 0.15)
    assert not second.done()
    await asyncio.gather(first, second, third)
    assert order.index("a-") < order.index("b+"), order
    assert order.index("c-") < order.index("a-"), "another rollout must not wait for this one's lock"


async def test_aborted_call_releases_the_lock(store: RolloutStore) -> None:
    trace = new_trace()
    first = await ticket(store, trace, "c1", lock=True)
    await store.abort(first)
    second = await asyncio.wait_for(ticket(store, trace, "c2", lock=True), 1)
    await store.finish(second, {}, ANSWER)


async def test_parallel_read_modify_write_loses_nothing(store: RolloutStore) -> None:
    trace = new_trace()

    async def bump(i: int) -> None:
        held = await ticket(store, trace, f"c{i}", lock=True)
        current = held.changes.get("p", {}).get("t", {}).get("n", 0)
        await asyncio.sleep(0)
        await store.finish(held, {"p": {"t": {"n": current + 1}}}, ANSWER)

    await asyncio.gather(*(bump(i) for i in range(40)))
    assert await store.changes(trace) == {"p": {"t": {"n": 40}}}


async def test_redis_stores_of_two_processes_share_the_lock(cluster: LocalCluster | None) -> None:
    """Each store queues its own calls locally; across stores only the Redis lock serializes them."""
    stores = [redis_store(cluster=cluster), redis_store(cluster=cluster)]
    trace = new_trace()

    async def bump(i: int) -> None:
        store = stores[i % 2]
        held = await ticket(store, trace, f"c{i}", lock=True)
        current = held.changes.get("p", {}).get("t", {}).get("n", 0)
        await asyncio.sleep(0.001)
        await store.finish(held, {"p": {"t": {"n": current + 1}}}, ANSWER)

    try:
        await asyncio.gather(*(bump(i) for i in range(30)))
        assert await stores[0].changes(trace) == {"p": {"t": {"n": 30}}}
        held = await ticket(stores[0], trace, "long", lock=True)
        short = redis_store(lock_wait=0.1, cluster=cluster)
        try:
            with pytest.raises(StoreUnavailable, match="lock"):
                await begin(short, trace, "other", lock=True)
        finally:
            await short.aclose()
        await stores[0].finish(held, {}, ANSWER)
    finally:
        for store in stores:
            await store.aclose()


async def test_lock_wait_runs_out(store: RolloutStore) -> None:
    trace = new_trace()
    short: RolloutStore = (
        MemoryRolloutStore(ttl_seconds=3600, lock_wait=0.1)
        if isinstance(store, MemoryRolloutStore)
        else redis_store(lock_wait=0.1)
    )
    try:
        # One store instance holds the memory store's locks, so hold the lock through `short` itself.
        held = await ticket(short, trace, None, lock=True)
        with pytest.raises(StoreUnavailable, match="lock"):
            await begin(short, trace, "c2", lock=True)
        await short.finish(held, {}, ANSWER)
        # The call that gave up left no claim behind: it runs when retried.
        retry = await ticket(short, trace, "c2", lock=True)
        await short.finish(retry, {}, ANSWER)
    finally:
        if short is not store:
            await short.aclose()


@pytest.mark.parametrize("redis_url", [None, REDIS_URL], ids=["memory", "redis"])
async def test_a_stores_503_says_the_configured_retry_after(tmp_path: Path, redis_url: str | None) -> None:
    settings = make_settings(tmp_path, redis_url=redis_url, tool_timeout_seconds=0.1, retry_after_seconds=7)
    store = build_store(settings)
    try:
        trace = new_trace()
        held = await ticket(store, trace, None, lock=True)
        with pytest.raises(StoreUnavailable, match="lock") as info:
            await begin(store, trace, "c2", lock=True)
        assert info.value.headers() == {"Retry-After": "7"}
        await store.finish(held, {}, ANSWER)
    finally:
        await store.aclose()


async def test_redis_local_locks_are_dropped_when_no_call_needs_them() -> None:
    """The per-rollout locks of this process go away with their last holder or waiter, including
    waiters that gave up and calls that were aborted: thousands of rollouts leave nothing behind."""
    store = redis_store(lock_wait=0.2)
    try:
        traces = [new_trace() for _ in range(20)]

        async def call(trace: str, n: int) -> None:
            began = await ticket(store, trace, f"c{n}", lock=True)
            await asyncio.sleep(0.01)
            if n % 3 == 0:
                await store.abort(began)
            else:
                await store.finish(began, {"p": {"t": {"k": n}}}, ANSWER)

        await asyncio.gather(*(call(trace, n) for trace in traces for n in range(4)))
        assert store._local_locks == {}
        # A waiter that runs out of time leaves no lock behind either.
        trace = new_trace()
        held = await ticket(store, trace, "c1", lock=True)
        with pytest.raises(StoreUnavailable, match="lock"):
            await begin(store, trace, "c2", lock=True)
        assert store._local_locks[trace].users == 1
        await store.finish(held, {}, ANSWER)
        assert store._local_locks == {}
    finally:
        await store.aclose()


async def test_deletes_are_tombstones_and_graded_flag(store: RolloutStore) -> None:
    trace = new_trace()
    await write(store, trace, {"p": {"things": {"a": {"n": 1}, "b": {"n": 2}}}})
    await write(store, trace, {"p": {"things": {"a": None}}})
    assert (await store.changes(trace)) == {"p": {"things": {"a": None, "b": {"n": 2}}}}
    assert not await store.is_graded(trace)
    await store.mark_graded(trace)
    assert await store.is_graded(trace)
    assert (await ticket(store, trace, None, lock=True)).graded


async def test_rollouts_are_isolated(store: RolloutStore) -> None:
    a, b = new_trace(), new_trace()
    await write(store, a, {"p": {"things": {"x": {"v": "a"}}}})
    assert await store.changes(b) == {}


async def test_redis_rollout_metadata_is_kept(cluster: LocalCluster | None) -> None:
    async with redis_store_and_client(cluster) as (store, client):
        trace = new_trace()
        await store.begin(
            CallStart(trace, None, meta=RolloutMeta(run="run-a", item_key="id:7", now=100.0), wait=1)
        )
        await store.begin(
            CallStart(trace, None, meta=RolloutMeta(run="run-b", item_key=None, now=200.0), wait=1)
        )
        stored = await client.hgetall(f"{REDIS_KEY_PREFIX}:{{{trace}}}:meta")
        assert stored == {
            b"first_seen": b"100.0",
            b"last_seen": b"200.0",
            b"run": b"run-a",
            b"item_key": b"id:7",
        }
        assert 0 < await client.pttl(f"{REDIS_KEY_PREFIX}:{{{trace}}}:meta") <= 3600 * 1000


async def test_redis_finish_refuses_a_lapsed_claim(cluster: LocalCluster | None) -> None:
    store = redis_store(cluster=cluster)
    try:
        trace = new_trace()
        stale = await ticket(store, trace, "c1", lock=True)
        # Simulate a stalled worker whose claim and lock expired, and a retry that took over.
        await store.abort(stale)
        retry = await ticket(store, trace, "c1", lock=True)
        with pytest.raises(StoreUnavailable, match="claim lapsed"):
            await store.finish(stale, {"p": {"t": {"k": 1}}}, StoredAnswer("stale", "ok"))
        assert await store.changes(trace) == {}, "a stale claim's writes must not be applied"
        await store.finish(retry, {"p": {"t": {"k": 2}}}, ANSWER)
        assert await store.changes(trace) == {"p": {"t": {"k": 2}}}
        assert await begin(store, trace, "c1") == ANSWER
    finally:
        await store.aclose()


async def test_redis_finish_refuses_a_lapsed_lock(cluster: LocalCluster | None) -> None:
    async with redis_store_and_client(cluster) as (store, client):
        trace = new_trace()
        stale = await ticket(store, trace, "c1", lock=True)
        # The lock expired under a stalled worker and another call holds it now.
        await client.set(f"{REDIS_KEY_PREFIX}:{{{trace}}}:lock", "someone-else")
        with pytest.raises(StoreUnavailable, match="lock lapsed"):
            await store.finish(stale, {"p": {"t": {"k": 1}}}, ANSWER)
        assert await store.changes(trace) == {}, "writes made without the lock must not be applied"
        assert await client.get(f"{REDIS_KEY_PREFIX}:{{{trace}}}:lock") == b"someone-else", (
            "another's lock is left alone"
        )
        assert await client.get(f"{REDIS_KEY_PREFIX}:{{{trace}}}:call:c1") is None, (
            "the claim is given up for a retry"
        )


async def test_redis_claim_of_a_crashed_worker_lapses(cluster: LocalCluster | None) -> None:
    async with redis_store_and_client(cluster, claim_timeout=0.3) as (store, client):
        trace = new_trace()
        # A claim written by a worker that died (no keep-alive runs for it).
        await client.set(f"{REDIS_KEY_PREFIX}:{{{trace}}}:call:c1", "P:deadbeef", px=300)
        await client.set(f"{REDIS_KEY_PREFIX}:{{{trace}}}:lock", "deadbeef", px=300)
        again = await begin(store, trace, "c1", lock=True, wait=3)
        assert isinstance(again, Ticket)
        await store.abort(again)


async def test_redis_keep_alive_holds_claim_and_lock_of_a_long_call(cluster: LocalCluster | None) -> None:
    # Expiries long enough that a loaded machine's stall of a few hundred ms does not lapse them.
    async with redis_store_and_client(cluster, claim_timeout=0.6, lock_timeout=0.6) as (store, client):
        trace = new_trace()
        long_call = await ticket(store, trace, "c1", lock=True)
        await asyncio.sleep(2.0)  # more than three expiries
        assert await client.get(f"{REDIS_KEY_PREFIX}:{{{trace}}}:call:c1") == f"P:{long_call.token}".encode()
        assert await client.get(f"{REDIS_KEY_PREFIX}:{{{trace}}}:lock") == long_call.token.encode()
        await store.finish(long_call, {"p": {"t": {"k": 1}}}, ANSWER)
        assert await client.get(f"{REDIS_KEY_PREFIX}:{{{trace}}}:lock") is None
        await asyncio.sleep(0.8)
        assert await begin(store, trace, "c1") == ANSWER, "the answer outlives the claim's expiry"


async def test_redis_begin_retried_after_a_lost_reply_keeps_its_claim(cluster: LocalCluster | None) -> None:
    async with redis_store_and_client(cluster) as (store, _):
        trace = new_trace()
        first = await ticket(store, trace, "c1", lock=True)
        # Redis applied the script but its reply was lost: the client runs it again with the same token.
        args = [first.token, "1100"]  # flags: ledger and lock, no touch, no read
        reply = await store._run(store._begin, trace, "c1", args)
        assert reply[0] == b"ok"
        # Anyone else is still refused the claim and the lock.
        other = await store._run(store._begin, trace, "c1", ["other-token", *args[1:]])
        assert other == [b"busy"]
        elsewhere = await store._run(store._begin, trace, "c2", ["other-token", *args[1:]])
        assert elsewhere == [b"locked"]
        await store.finish(first, {}, ANSWER)


async def test_redis_reloads_its_scripts_after_a_flush(cluster: LocalCluster | None) -> None:
    async with redis_store_and_client(cluster) as (store, client):
        trace = new_trace()
        await client.script_flush()  # as after a Redis restart: the server knows no script
        began = await ticket(store, trace, "c1", lock=True)
        await client.script_flush()
        await store.finish(began, {"p": {"t": {"k": 1}}}, ANSWER)
        assert await begin(store, trace, "c1") == ANSWER


async def test_redis_scripts_of_one_turn_reload_after_a_flush_together(cluster: LocalCluster | None) -> None:
    """One pipeline where every script gets an error reply: each is loaded again and answered."""
    async with redis_store_and_client(cluster) as (store, client):
        traces = [new_trace() for _ in range(6)]
        await client.script_flush()
        tickets = await asyncio.gather(*(ticket(store, trace, "c1", lock=True) for trace in traces))
        await client.script_flush()
        await asyncio.gather(
            *(store.finish(t, {"p": {"t": {"k": i}}}, ANSWER) for i, t in enumerate(tickets))
        )
        for i, trace in enumerate(traces):
            assert await begin(store, trace, "c1") == ANSWER
            assert (await store.changes(trace))["p"]["t"]["k"] == i


async def test_redis_connection_closed_by_the_server_is_retried_on_a_new_one() -> None:
    """Redis dropped the pooled connections (a restart, CLIENT KILL, an idle timeout): the next
    pipeline fails on the dead socket and goes again on a new connection, without an error."""
    async with redis_store_and_client() as (store, client):
        traces = [new_trace() for _ in range(4)]
        tickets = await asyncio.gather(*(ticket(store, trace, "c1", lock=True) for trace in traces))
        killed = await client.client_kill_filter(_type="normal", skipme=True)
        assert killed >= 1
        await asyncio.gather(*(store.finish(t, {"p": {"t": {"k": 1}}}, ANSWER) for t in tickets))
        for trace in traces:
            assert await client.get(f"{REDIS_KEY_PREFIX}:{{{trace}}}:lock") is None
            assert await begin(store, trace, "c1") == ANSWER


async def test_redis_that_never_answers_is_store_unavailable() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(-1)  # accept and read, never reply
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisRolloutStore(
        Redis.from_url(f"redis://127.0.0.1:{port}/0"),
        ttl_seconds=60,
        lock_timeout=1,
        claim_timeout=1,
        lock_wait=1,
        op_timeout=0.3,
    )
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="did not answer"):
            await begin(store, new_trace(), "c1", lock=True)
        assert time.monotonic() - started < 5
    finally:
        await store.aclose()
        server.close()


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
            await begin(store, new_trace(), "c1", lock=True)
        assert info.value.status_code == 503
    finally:
        await store.aclose()


# Ids that are key syntax in a naive layout: hash-tag braces, the ':' and 'call:' separators, the
# state field separator, percent signs (the escape), unicode, empty, and long ones.
HOSTILE_TRACES = [
    "rA",
    "rA}:call:k",
    "rA}",
    "{rA}",
    "rA:call:k",
    "rA%7D:call:k",
    "r\x1fA",
    "rÄ🙂",
    "",
    "t" * 300,
]
HOSTILE_CALLS = [
    "c1",
    "k}:call:c1",
    "k",
    "}:meta",
    ":meta",
    "meta",
    "%",
    "%25",
    "c\x1f1",
    "ç🙂",
    "",
    "c" * 300,
]


async def test_hostile_ids_never_share_a_ledger_entry(store: RolloutStore) -> None:
    """Every (trace_id, call_id) pair has its own ledger entry, whatever characters the ids hold."""
    suffix = new_trace()  # keeps this run's rollouts apart from earlier runs' on the shared Redis
    pairs = [(trace + suffix, call) for trace in HOSTILE_TRACES for call in HOSTILE_CALLS]
    pairs += [
        (trace, call) for trace in ("rA" + suffix, "rA" + suffix + "}:call:k") for call in HOSTILE_CALLS
    ]
    for trace, call in pairs:
        began = await begin(store, trace, call, lock=True)
        if isinstance(began, Ticket):
            await store.finish(
                began, {"p": {"t": {call: trace}}}, StoredAnswer(output=f"{trace}|{call}", outcome="ok")
            )
    for trace, call in pairs:
        replay = await begin(store, trace, call, lock=True)
        assert replay == StoredAnswer(output=f"{trace}|{call}", outcome="ok"), (trace, call)
    for trace in {trace for trace, _ in pairs}:
        assert await store.changes(trace) == {"p": {"t": {call: trace for call in HOSTILE_CALLS}}}, trace


async def test_an_id_cannot_read_another_rollouts_answer(store: RolloutStore) -> None:
    trace = new_trace()
    first = await ticket(store, trace, "k}:call:c1")
    await store.finish(first, {}, StoredAnswer(output="the answer of rA", outcome="ok"))
    other = await begin(store, f"{trace}}}:call:k", "c1")
    assert isinstance(other, Ticket), "a call of another rollout must run, not replay rA's answer"
    await store.abort(other)


async def test_what_a_store_hands_out_or_takes_in_is_a_copy(store: RolloutStore) -> None:
    """A tool may change the records it read, or the writes it handed over, without changing the store."""
    trace = new_trace()
    writes: PackChanges = {"p": {"t": {"k": {"items": [1, 2], "meta": {"n": 1}}}}}
    held = await ticket(store, trace, "c1", lock=True)
    await store.finish(held, writes, ANSWER)
    writes["p"]["t"]["k"]["items"].append(3)  # after it was handed over
    began = await ticket(store, trace, "c2", lock=True)
    began.changes["p"]["t"]["k"]["meta"]["n"] = 99  # what the call read
    began.changes["p"]["t"]["k"]["items"].clear()
    read = await store.changes(trace)
    read["p"]["t"]["k"]["items"].append(4)  # what a reader got
    await store.abort(began)
    assert await store.changes(trace) == {"p": {"t": {"k": {"items": [1, 2], "meta": {"n": 1}}}}}
