"""`make test` on a machine others share: the session's names are its own, and it leaves no Redis key
behind. The server keeps every Redis key under SPARRING_REDIS_KEY_PREFIX, so a run (or a deployment)
sharing one Redis database with others owns a prefix it can clear."""

from __future__ import annotations

import uuid

import pytest
from redis import Redis

from tests.conftest import (
    REDIS_KEY_PREFIX,
    REDIS_URL,
    RUN_ID,
    AppFactory,
    call_body,
    delete_redis_keys,
    new_trace,
)


@pytest.fixture
def backend() -> str:
    return "real"


async def test_every_redis_key_of_a_rollout_is_under_the_configured_prefix(app_factory: AppFactory) -> None:
    trace = new_trace()
    prefix = f"sptest-own-{uuid.uuid4().hex[:8]}"
    async with app_factory(redis_key_prefix=prefix) as client:
        response = await client.post(
            "/tools/increment", json=call_body('{"by": 2}', trace_id=trace, call_id="c1")
        )
        assert response.status_code == 200, response.text
    redis = Redis.from_url(REDIS_URL)
    try:
        mine = sorted(key.decode() for key in redis.scan_iter(match=f"*{trace}*", count=1000))
        assert mine and all(key.startswith(f"{prefix}:{{{trace}}}:") for key in mine), mine
    finally:
        assert delete_redis_keys(REDIS_URL, prefix) == len(mine)
        redis.close()


def test_the_cleanup_deletes_the_runs_keys_and_nothing_else() -> None:
    prefix = f"sptest-clean-{uuid.uuid4().hex[:8]}"
    other = f"sptest-other-{uuid.uuid4().hex[:8]}"
    redis = Redis.from_url(REDIS_URL)
    try:
        for i in range(1500):  # more than one batch
            redis.set(f"{prefix}:{{trace_{i}}}:meta", "1", ex=600)
        redis.set(f"{other}:{{trace_1}}:meta", "1", ex=600)
        redis.set(f"{prefix}x:{{trace_1}}:meta", "1", ex=600)  # a longer prefix is another run's
        assert delete_redis_keys(REDIS_URL, prefix) == 1500
        assert list(redis.scan_iter(match=f"{prefix}:*", count=1000)) == []
        assert redis.exists(f"{other}:{{trace_1}}:meta", f"{prefix}x:{{trace_1}}:meta") == 2
    finally:
        redis.delete(f"{other}:{{trace_1}}:meta", f"{prefix}x:{{trace_1}}:meta")
        redis.close()


def test_the_sessions_names_are_unique_per_run(pg_database: str) -> None:
    assert pg_database.rsplit("/", 1)[1] == f"sparring_test_{RUN_ID}"
    assert REDIS_KEY_PREFIX.endswith(RUN_ID) and len(RUN_ID.rsplit("_", 1)[1]) == 8
