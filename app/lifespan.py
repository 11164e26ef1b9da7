"""Builds every resource at start-up (engine, Redis, registry, log writer) and disposes of them."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from app.auth import build_keyring, ensure_local_admin_key
from app.calls.log_writer import CallLogWriter
from app.calls.service import ToolCallService
from app.config import ApiKey, Settings
from app.db.migrate import check_schema
from app.db.session import build_engine, build_sessionmaker
from app.metrics import Metrics
from app.packs import Registry
from app.rollouts.memory import MemoryRolloutStore
from app.rollouts.redis_store import RedisRolloutStore
from app.rollouts.store import RolloutStore
from app.sdk import Pack

log = logging.getLogger("sparring")


class StartupError(RuntimeError):
    """The server cannot start as configured; the message says what to change."""


@dataclass(frozen=True)
class AppOptions:
    """What create_app was given beyond settings (tests inject packs this way)."""

    packs: tuple[Pack, ...] | None = None


def build_store(settings: Settings) -> RolloutStore:
    if settings.redis_url is None:
        return MemoryRolloutStore(ttl_seconds=settings.state_ttl_seconds)
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_max_connections,
        timeout=5,
        socket_timeout=5,
        socket_connect_timeout=2,
        health_check_interval=30,
    )
    client = Redis(connection_pool=pool, retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 2))
    return RedisRolloutStore(
        client,
        ttl_seconds=settings.state_ttl_seconds,
        lock_timeout=settings.lock_timeout_seconds,
        claim_timeout=settings.claim_timeout_seconds,
        lock_wait=settings.tool_timeout_seconds,
    )


def worker_name(settings: Settings) -> str:
    return settings.worker_name or f"{socket.gethostname()}:{os.getpid()}"


def _keys(settings: Settings) -> list[ApiKey]:
    if settings.keys:
        return []
    if not settings.binds_loopback:
        raise StartupError(
            f"no API keys configured and the server binds {settings.host}: set SPARRING_API_KEYS "
            "(e.g. 'tools:<key>,grader:<key>,admin:<key>') before exposing it"
        )
    from pydantic import SecretStr

    key, created = ensure_local_admin_key(settings.home)
    where = settings.home / "admin.key"
    log.warning(
        "%s admin key in %s (no SPARRING_API_KEYS set; this server only listens on %s)",
        "created an" if created else "using the",
        where,
        settings.host,
    )
    return [ApiKey(scope="admin", secret=SecretStr(key))]


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    options: AppOptions = app.state.options
    registry = (
        Registry.from_packs(options.packs)
        if options.packs is not None
        else Registry.from_names(settings.packs)
    )
    app.state.registry = registry
    app.state.keyring = build_keyring(settings, _keys(settings))

    if settings.is_embedded_db:
        settings.home.mkdir(parents=True, exist_ok=True)
    engine = build_engine(settings.effective_database_url, pool_size=settings.db_pool_size)
    store: RolloutStore | None = None
    writer: CallLogWriter | None = None
    try:
        await check_schema(engine)
        store = build_store(settings)
        if store.kind == "memory":
            log.warning(
                "rollout state is in memory: run exactly one worker process "
                "(set SPARRING_REDIS_URL to share state between workers and replicas)"
            )
        metrics = Metrics(settings.metrics_dir)
        app.state.metrics = metrics
        writer = CallLogWriter(
            engine,
            metrics=metrics,
            queue_size=settings.log_queue_size,
            batch_size=settings.log_batch_size,
            retry_after=settings.retry_after_seconds,
        )
        writer.start()
        app.state.engine = engine
        app.state.sessionmaker = build_sessionmaker(engine)
        app.state.store = store
        app.state.log_writer = writer
        app.state.call_service = ToolCallService(
            registry=registry,
            store=store,
            log_writer=writer,
            worker=worker_name(settings),
            max_output_bytes=settings.max_output_bytes,
            tool_timeout=settings.tool_timeout_seconds,
            metrics=metrics,
        )
        yield
    finally:
        if writer is not None:
            await writer.aclose()
        if store is not None:
            await store.aclose()
        await engine.dispose()
