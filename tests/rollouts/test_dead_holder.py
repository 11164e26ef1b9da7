"""A worker killed while it holds a rollout's lock and a call's claim blocks that rollout only briefly."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from redis.asyncio import Redis

from app.config import Settings
from app.rollouts.redis_store import RedisRolloutStore
from app.rollouts.store import CallStart, StoredAnswer, Ticket
from tests.conftest import REDIS_KEY_PREFIX, REDIS_URL, new_trace
from tests.rollouts.test_stores import meta

pytestmark = pytest.mark.slow

# A worker built with the default settings: it takes the rollout's lock and a claim, says so, and
# is killed while it holds them (no finish, no abort, its keep-alive dies with it).
HOLDER = """
import asyncio, sys, time
from app.config import Settings
from app.lifespan import build_store
from app.rollouts.store import CallStart, RolloutMeta

async def main() -> None:
    store = build_store(Settings(redis_url=sys.argv[1], redis_key_prefix=sys.argv[3]))
    meta = RolloutMeta(run=None, item_key=None, now=time.time())
    await store.begin(CallStart(sys.argv[2], "c1", lock=True, meta=meta, load_changes=True, wait=5))
    print("held", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


ROOT = Path(__file__).resolve().parents[2]


async def test_a_killed_holder_stops_blocking_its_rollout_within_seconds() -> None:
    trace = new_trace()
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HOLDER,
        REDIS_URL,
        trace,
        REDIS_KEY_PREFIX,
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert holder.stdout is not None
        line = await asyncio.wait_for(holder.stdout.readline(), 30)
        assert line.strip() == b"held"
        await asyncio.sleep(2.5)  # the holder's keep-alive ran at least once
        holder.send_signal(signal.SIGKILL)
        await asyncio.wait_for(holder.wait(), 10)
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()
    # Another worker with the default expiries, willing to wait 8 s (the bound is ~5 s).
    defaults = Settings()
    other = RedisRolloutStore(
        Redis.from_url(REDIS_URL),
        key_prefix=REDIS_KEY_PREFIX,
        ttl_seconds=defaults.state_ttl_seconds,
        lock_timeout=defaults.lock_timeout_seconds,
        claim_timeout=defaults.claim_timeout_seconds,
        lock_wait=8,
    )
    try:
        # The retry of the killed call gets its claim once it lapsed, and the lock with it.
        retry = await other.begin(CallStart(trace, "c1", lock=True, meta=meta(), load_changes=True, wait=8))
        assert isinstance(retry, Ticket), retry
        await other.finish(retry, {}, StoredAnswer(output="ran again", outcome="ok"))
        nxt = await other.begin(CallStart(trace, "c2", lock=True, meta=meta(), load_changes=True, wait=1))
        assert isinstance(nxt, Ticket)
        await other.finish(nxt, {}, StoredAnswer(output="next", outcome="ok"))
    finally:
        await other.aclose()
