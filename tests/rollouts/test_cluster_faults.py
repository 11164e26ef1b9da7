"""A Redis Cluster losing a shard (killed or paused), getting it back, and moving a slot under rollouts.

Each test has its own local three-shard cluster (tests/redis_cluster.py), its shards writing an
append-only file so that a killed shard comes back with its data, as a production shard does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import orjson
import pytest

from app.deps import app_state
from tests.call_log import logged_calls_on
from tests.conftest import ADMIN_KEY, AppFactory, call_body, new_trace
from tests.packs import counter_pack
from tests.redis_cluster import LocalCluster, local_cluster

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
def backend() -> str:
    return "cluster"


@pytest.fixture
def redis_cluster() -> Iterator[LocalCluster]:
    """This test's own cluster (it stops or moves parts of it)."""
    with local_cluster(persist=True) as cluster:
        yield cluster


def on_two_shards(cluster: LocalCluster) -> tuple[str, str, int]:
    """A rollout, another rollout on another shard, and the port of the first one's shard."""
    first = new_trace()
    port = cluster.port_of_key(f"{{{first}}}")
    while True:
        other = new_trace()
        if cluster.port_of_key(f"{{{other}}}") != port:
            return first, other, port


async def increment(client: httpx.AsyncClient, trace: str, call_id: str) -> httpx.Response:
    return await client.post("/tools/increment", json=call_body({"by": 1}, trace_id=trace, call_id=call_id))


def value(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(orjson.loads(response.json()["output"])["value"])


def assert_unavailable(response: httpx.Response) -> None:
    """A 503 with Retry-After and the stable error body: never a 200 without the state, never a 500."""
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"].isdigit()
    assert response.json()["error"]


async def answered_once_back(client: httpx.AsyncClient, trace: str, call_id: str) -> httpx.Response:
    """The call retried as a trainer does (503s while the shard comes back), until it is answered."""
    for _ in range(40):
        response = await increment(client, trace, call_id)
        if response.status_code == 200:
            return response
        assert_unavailable(response)
        await asyncio.sleep(0.25)
    raise AssertionError(f"{trace} was not served again after its shard came back")


async def infra_errors(client: httpx.AsyncClient, trace: str) -> list[dict[str, object]]:
    engine = app_state(client.app).engine  # type: ignore[attr-defined]
    for _ in range(50):  # the log is written in batches, shortly after the answer
        rows = await logged_calls_on(engine, [trace], attempts=True)
        failed = [row for row in rows if row["outcome"] == "infra_error"]
        if failed:
            return failed
        await asyncio.sleep(0.1)
    return []


async def test_a_killed_shard_fails_only_its_rollouts_and_they_come_back(
    app_factory: AppFactory, redis_cluster: LocalCluster
) -> None:
    async with app_factory(packs=[counter_pack]) as client:
        lost, kept, port = on_two_shards(redis_cluster)
        assert value(await increment(client, lost, "l1")) == 101
        assert value(await increment(client, kept, "k1")) == 101

        await asyncio.to_thread(redis_cluster.stop_node, port)
        assert_unavailable(await increment(client, lost, "l2"))
        assert value(await increment(client, kept, "k2")) == 102  # the other shards keep working
        assert (await client.get("/readyz")).status_code == 200  # this worker still serves them
        failed = await infra_errors(client, lost)
        assert failed and all(row["status_code"] == 503 for row in failed)

        await asyncio.to_thread(redis_cluster.restart_node, port)
        # Back with its state: the retried call applies once, on top of the first; the first replays.
        assert value(await answered_once_back(client, lost, "l2")) == 102
        assert value(await increment(client, lost, "l1")) == 101
        assert value(await increment(client, kept, "k3")) == 103


async def test_a_paused_shard_is_a_503_in_bounded_time_while_the_others_answer(
    app_factory: AppFactory, redis_cluster: LocalCluster
) -> None:
    async with app_factory(packs=[counter_pack]) as client:
        stuck, kept, port = on_two_shards(redis_cluster)
        assert value(await increment(client, stuck, "s1")) == 101
        assert value(await increment(client, kept, "k1")) == 101

        redis_cluster.pause_node(port)
        try:
            waiting = asyncio.ensure_future(increment(client, stuck, "s2"))
            # While the paused shard holds that call, the other shard's rollouts are answered.
            values = [value(await increment(client, kept, f"k{n}")) for n in range(2, 6)]
            assert values == [102, 103, 104, 105]
            ready = await client.get("/readyz")  # ready: some shard answers
            assert ready.status_code == 200, ready.text
            assert_unavailable(await asyncio.wait_for(waiting, 30))  # never a hang
        finally:
            redis_cluster.resume_node(port)
        await asyncio.to_thread(redis_cluster.wait_ok)

        assert value(await answered_once_back(client, stuck, "s2")) == 102
        assert value(await increment(client, stuck, "s1")) == 101


async def test_a_rollout_whose_slot_moves_follows_it(
    app_factory: AppFactory, redis_cluster: LocalCluster
) -> None:
    """A slot migrated between shards mid-rollout: ASK while half-moved, MOVED after; state and the
    ledger move with it."""
    async with app_factory(packs=[counter_pack]) as client:
        trace = new_trace()
        slot = redis_cluster.slot_of(f"{{{trace}}}")
        source = redis_cluster.port_of_key(f"{{{trace}}}")
        target = next(port for port in redis_cluster.ports if port != source)
        assert value(await increment(client, trace, "c1")) == 101

        await asyncio.to_thread(redis_cluster.move_slot, slot, source, target, finish=False)
        # Half-moved: the source says ASK, the target TRYAGAIN for keys it has not got (a new call's
        # ledger entry): the call waits for the move to end, then applies once.
        during = asyncio.ensure_future(increment(client, trace, "c2"))
        await asyncio.sleep(0.3)
        await asyncio.to_thread(redis_cluster.finish_move, slot, target)
        assert value(await during) == 102
        assert redis_cluster.port_of_key(f"{{{trace}}}") == target
        assert value(await increment(client, trace, "c3")) == 103  # moved: the client's map follows
        assert value(await increment(client, trace, "c1")) == 101  # the ledger moved too
        state = await client.get(f"/rollouts/{trace}/state", headers=ADMIN)
        assert state.status_code == 200, state.text
