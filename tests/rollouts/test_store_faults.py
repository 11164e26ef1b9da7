"""The Redis store behind a proxy that drops its connections mid-load: every failure is an outage."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

import pytest
import uvloop
from redis.asyncio import Redis

from app.rollouts.redis_store import RedisRolloutStore
from app.rollouts.store import CallStart, StoredAnswer, StoreUnavailable, Ticket
from tests.conftest import REDIS_KEY_PREFIX, REDIS_URL, new_trace
from tests.faults import DroppingProxy
from tests.rollouts.test_stores import meta

pytestmark = pytest.mark.slow

ANSWER = StoredAnswer(output="ok", outcome="ok")


async def _calls_under_drops(rounds: int) -> tuple[int, list[BaseException]]:
    """Calls of many rollouts while the proxy resets every connection every few milliseconds.

    Returns how many calls were answered once the drops stopped (one per rollout) and every
    exception a call met while they went on.
    """
    target = urlsplit(REDIS_URL)
    proxy = await DroppingProxy(target.hostname or "127.0.0.1", target.port or 6379).start()
    client = Redis.from_url(f"redis://127.0.0.1:{proxy.port}{target.path}", socket_connect_timeout=1)
    store = RedisRolloutStore(
        client,
        key_prefix=REDIS_KEY_PREFIX,
        ttl_seconds=60,
        lock_timeout=2,
        claim_timeout=2,
        lock_wait=2,
        op_timeout=2,
    )
    failures: list[BaseException] = []
    traces = [new_trace() for _ in range(24)]

    async def call(trace: str, call_id: str) -> None:
        began = await store.begin(
            CallStart(trace, call_id, lock=True, meta=meta(), load_changes=True, wait=2)
        )
        if isinstance(began, Ticket):
            try:
                await asyncio.sleep(0)
                await store.finish(began, {"p": {"t": {"k": call_id}}}, ANSWER)
            except BaseException:
                await store.abort(began)
                raise

    async def one_rollout(trace: str, rep: int) -> None:
        for k in range(rounds):
            try:
                await call(trace, f"c{rep}_{k}")
            except Exception as exc:
                failures.append(exc)

    async def dropper() -> None:
        while True:
            await asyncio.sleep(0.003)
            proxy.drop()

    dropping = asyncio.create_task(dropper())
    try:
        try:
            # Until the drops have met some calls: on a quiet machine one pass can finish between
            # two drops, or see each of its pipelines retried on a new connection in time.
            for rep in range(40):
                await asyncio.wait_for(asyncio.gather(*(one_rollout(trace, rep) for trace in traces)), 120)
                if failures:
                    break
        finally:
            dropping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dropping

        # Redis is reachable again: the store recovers by itself. A rollout lock whose release a drop
        # lost is freed by its lease (lock_timeout), so a rollout's next call may wait that long, and
        # on a loaded machine a first try may still meet the lock: each rollout's call is retried,
        # as a trainer would, within a few leases.
        async def answered_after(trace: str) -> BaseException | None:
            failure: BaseException | None = None
            for attempt in range(5):
                try:
                    await call(trace, f"after{attempt}")
                    return None
                except StoreUnavailable as exc:
                    failure = exc
                    await asyncio.sleep(1)
            return failure

        after = await asyncio.gather(*(answered_after(trace) for trace in traces), return_exceptions=True)
    finally:
        await store.aclose()
        await proxy.aclose()
    assert proxy.drops > 0
    return sum(1 for result in after if result is None), failures


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_dropped_connections_are_only_ever_store_unavailable(loop: str) -> None:
    """uvloop raises RuntimeError writing to a reset transport; that is an outage too, never a 500."""
    runner = uvloop.run if loop == "uvloop" else asyncio.run
    answered_after, failures = runner(_calls_under_drops(rounds=15))
    assert failures, "the drops must have failed some calls, or this test proves nothing"
    others = [f"{type(exc).__name__}: {exc}" for exc in failures if not isinstance(exc, StoreUnavailable)]
    assert not others, others[:5]
    assert answered_after == 24, "once the drops stop, every rollout's next call is answered"
