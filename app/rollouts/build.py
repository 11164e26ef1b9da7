"""The rollout state store the settings ask for: Redis (shared by every worker) or memory (one process)."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from app.config import Settings
from app.rollouts.memory import MemoryRolloutStore
from app.rollouts.redis_packing import use_hiredis_packing
from app.rollouts.redis_store import RedisRolloutStore
from app.rollouts.store import RolloutStore


def build_store(settings: Settings) -> RolloutStore:
    if settings.redis_url is None:
        return MemoryRolloutStore(
            ttl_seconds=settings.state_ttl_seconds, lock_wait=settings.tool_timeout_seconds
        )
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_max_connections,
        timeout=5,
        # No per-socket timeout: the store puts one deadline on each whole operation instead, which
        # costs one timer rather than a task and a timer per command.
        socket_timeout=None,
        socket_connect_timeout=2,
        health_check_interval=30,
        # On the pool: a client given a pool takes the retry policy of the pool's connections.
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 2),
    )
    use_hiredis_packing(pool)
    client = Redis(connection_pool=pool)
    return RedisRolloutStore(
        client,
        ttl_seconds=settings.state_ttl_seconds,
        lock_timeout=settings.lock_timeout_seconds,
        claim_timeout=settings.claim_timeout_seconds,
        lock_wait=settings.tool_timeout_seconds,
        key_prefix=settings.redis_key_prefix,
    )
