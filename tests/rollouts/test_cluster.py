"""SPARRING_REDIS_CLUSTER: what the settings accept, and where a rollout's keys land on a real cluster."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from app.config import Settings
from app.errors import StartupError
from app.rollouts.build import build_store
from tests.conftest import AppFactory, call_body, new_trace
from tests.packs import counter_pack
from tests.redis_cluster import LocalCluster
from tests.system.test_startup_errors import assert_brief, serve


@pytest.fixture
def backend() -> str:
    return "cluster"


@pytest.mark.parametrize("url", ["redis://127.0.0.1:7000/3", "redis://127.0.0.1:7000/9?x=1"])
def test_a_database_number_is_refused_in_one_line(url: str) -> None:
    with pytest.raises(StartupError, match=r"database (3|9) but a Redis Cluster has only database 0"):
        build_store(Settings(redis_url=url, redis_cluster=True))


def test_a_cluster_without_a_seed_url_is_refused() -> None:
    with pytest.raises(StartupError, match="needs SPARRING_REDIS_URL"):
        build_store(Settings(redis_cluster=True))


async def test_sparring_serve_says_to_drop_the_database_number(tmp_path: Path) -> None:
    done = await asyncio.to_thread(
        serve,
        tmp_path,
        "--migrate",
        SPARRING_REDIS_URL="redis://127.0.0.1:7000/2",
        SPARRING_REDIS_CLUSTER="true",
    )
    assert_brief(done, "SPARRING_REDIS_URL names database 2", "drop the /<db>")


def _keys_by_port(cluster: LocalCluster, pattern: str) -> dict[int, list[bytes]]:
    found: dict[int, list[bytes]] = {}
    for port in cluster.ports:
        node = redis.Redis(host="127.0.0.1", port=port)
        try:
            keys = list(node.scan_iter(match=pattern, count=1000))
        finally:
            node.close()
        if keys:
            found[port] = keys
    return found


async def test_every_key_of_a_rollout_lives_in_one_slot(
    app_factory: AppFactory, redis_cluster: LocalCluster
) -> None:
    traces = [new_trace() for _ in range(12)]
    async with app_factory(packs=[counter_pack]) as client:
        for trace in traces:
            for n in range(3):
                body = call_body({"by": 1}, trace_id=trace, call_id=f"c{n}")
                assert (await client.post("/tools/increment", json=body)).status_code == 200
    shards_used: set[int] = set()
    for trace in traces:
        found = _keys_by_port(redis_cluster, f"*{{{trace}}}*")
        assert len(found) == 1, f"{trace}: keys on {sorted(found)}"
        port, keys = next(iter(found.items()))
        assert len(keys) >= 5  # meta, state and three ledger entries
        slots = {redis_cluster.slot_of(key.decode()) for key in keys}
        assert len(slots) == 1, f"{trace}: keys in slots {slots}"
        shards_used.add(port)
    assert len(shards_used) > 1  # rollouts are spread over the shards
