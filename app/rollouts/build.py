"""The rollout state store the settings ask for: Redis (shared by every worker) or memory (one process)."""

from __future__ import annotations

from urllib.parse import urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from app.config import Settings
from app.errors import StartupError
from app.rollouts.memory import MemoryRolloutStore
from app.rollouts.redis_packing import use_hiredis_packing, use_hiredis_packing_on_cluster
from app.rollouts.redis_store import RedisRolloutStore
from app.rollouts.store import RolloutStore

# How long one Redis node may keep a command unanswered in cluster mode before the client counts it
# as down and asks the others for the slot map (a paused shard must not hold up the other shards).
CLUSTER_SOCKET_TIMEOUT = 2.0


def build_store(settings: Settings) -> RolloutStore:
    if settings.redis_url is None:
        if settings.redis_cluster:
            raise StartupError(
                "SPARRING_REDIS_CLUSTER=true needs SPARRING_REDIS_URL (a seed node of the cluster)"
            )
        return MemoryRolloutStore(
            ttl_seconds=settings.state_ttl_seconds,
            lock_wait=settings.tool_timeout_seconds,
            retry_after=settings.retry_after_seconds,
        )
    client = _cluster_client(settings.redis_url, settings) if settings.redis_cluster else _client(settings)
    return RedisRolloutStore(
        client,
        ttl_seconds=settings.state_ttl_seconds,
        lock_timeout=settings.lock_timeout_seconds,
        claim_timeout=settings.claim_timeout_seconds,
        lock_wait=settings.tool_timeout_seconds,
        key_prefix=settings.redis_key_prefix,
        retry_after=settings.retry_after_seconds,
    )


def _client(settings: Settings) -> Redis:
    assert settings.redis_url is not None
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
    return Redis(connection_pool=pool)


def cluster_seed(url: str) -> str:
    """The seed node's URL as given; a database number other than 0 is refused (a cluster has only db 0)."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise StartupError(
            f"SPARRING_REDIS_URL must be redis://host:port (or rediss://) with SPARRING_REDIS_CLUSTER=true, "
            f"not {parts.scheme}://"
        )
    database = parts.path.strip("/")
    if database not in ("", "0"):
        raise StartupError(
            f"SPARRING_REDIS_URL names database {database} but a Redis Cluster has only database 0: "
            "drop the /<db> from the URL (SPARRING_REDIS_CLUSTER=true)"
        )
    return url


def _cluster_client(url: str, settings: Settings) -> RedisCluster:
    client = RedisCluster.from_url(
        cluster_seed(url),
        max_connections=settings.redis_max_connections,
        socket_timeout=CLUSTER_SOCKET_TIMEOUT,
        socket_connect_timeout=2,
        # A slot whose shard is down is answered 503 for its rollouts; the others keep working.
        require_full_coverage=False,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 2),
    )
    use_hiredis_packing_on_cluster(client)
    return client
