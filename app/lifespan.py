"""Builds every resource at start-up into the typed `AppState` (app/deps.py) and disposes of them."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager

import anyio.to_thread
from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncEngine

from app.auth import build_keyring, ensure_local_admin_key
from app.calls.log_writer import CallLogWriter
from app.calls.service import ToolCallService
from app.config import ApiKey, Settings
from app.db.migrate import SchemaOutOfDate, check_schema, unreachable_database
from app.db.models import WORKER_MAX
from app.db.session import Database, build_engine, build_sessionmaker
from app.deps import AppState, set_app_state, set_startup_failure
from app.episodes.episode import check_submit_is_free
from app.episodes.ors import check_pack_names
from app.errors import OUTAGES, StartupError
from app.grading.build import build_grading
from app.grading.graders.registry import GraderContext
from app.grading.service import GradingService
from app.mcp.http import McpHttp
from app.metrics import Metrics
from app.packs import PackLoadError, PackOverrides, Registry, start_packs
from app.remote.build import build_model_http, build_remote
from app.remote.service import RemoteRolloutService
from app.retention.service import keep_partitions, upkeep_round
from app.rollouts.build import build_store
from app.rollouts.identity import fit
from app.rollouts.store import RolloutStore
from app.sdk import Pack
from app.telemetry import Tracing, build_tracing
from app.users.service import UserToolConversations, build_user, offer_user_tool
from sparring.usersim import SimulatedUser

log = logging.getLogger("sparring")


_startup_frozen = False


def _freeze_startup_objects() -> None:
    """Move everything built at start-up out of the garbage collector's sight, once per process.

    Packs' base data, the app and the libraries live as long as the process. Left tracked, each full
    collection under load scanned them all and paused every request for tens of milliseconds (the
    benchmark's p99 at 32 concurrent calls fell from about 100 ms to about 25 ms with this).
    """
    global _startup_frozen
    if not _startup_frozen:
        gc.freeze()
        _startup_frozen = True


def worker_name(settings: Settings) -> str:
    """The name each logged call and remote rollout keeps of its worker, fitted to its column (a host's
    fully qualified name may be 253 characters: Postgres refused every commit of the call log)."""
    return fit(settings.worker_name or f"{socket.gethostname()}:{os.getpid()}", WORKER_MAX)


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


def build_lifespan(
    settings: Settings, packs: tuple[Pack, ...] | None = None, pack_settings: PackOverrides | None = None
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: builds its `AppState` from `settings` (and `packs` and their `pack_settings`,
    which tests and embedders give in code; otherwise each pack reads its SPARRING_<PACK>_* variables)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started = False
        try:
            async with _resources(settings, packs, pack_settings) as state:
                set_app_state(app, state)
                started = True
                yield
        except (StartupError, SchemaOutOfDate) as exc:
            if not started:  # what `SparringApp` reports instead of the traceback (app/main.py)
                set_startup_failure(app, str(exc))
            raise

    return lifespan


@asynccontextmanager
async def _resources(
    settings: Settings, packs: tuple[Pack, ...] | None, pack_settings: PackOverrides | None
) -> AsyncIterator[AppState]:
    """Every resource, each registered with its cleanup as soon as it exists: shutdown, or a start-up
    step that fails, releases what was built so far in reverse order."""
    try:
        registry = Registry.from_packs(packs) if packs is not None else Registry.from_names(settings.packs)
    except PackLoadError as exc:
        raise StartupError(str(exc)) from exc
    _check_episode_names(settings, registry)
    keyring = build_keyring(settings, _keys(settings))

    if settings.is_embedded_db:
        settings.home.mkdir(parents=True, exist_ok=True)
    async with AsyncExitStack() as stack:
        engine = build_engine(settings.effective_database_url, pool_size=settings.db_pool_size)
        stack.push_async_callback(engine.dispose)
        # Packs stop after everything that calls their tools or checks, and before the database goes.
        registry = await stack.enter_async_context(
            start_packs(
                registry,
                home=settings.home,
                binds_loopback=settings.binds_loopback,
                overrides=pack_settings,
            )
        )
        if settings.user_tool:
            offered = offer_user_tool(registry)
            log.info("send_message_to_user is offered in the packs %s", ", ".join(offered) or "(none)")
        try:
            await check_schema(engine)
        except OUTAGES as exc:
            raise StartupError(unreachable_database(settings.effective_database_url, exc)) from exc
        await _start_partition_upkeep(stack, engine)
        store = _open_store(stack, settings)
        metrics = Metrics(settings.metrics_dir)
        tracing = _start_tracing(stack, settings, metrics)
        writer = _start_log_writer(stack, engine, settings, metrics)
        sessionmaker = build_sessionmaker(engine)
        database = Database(sessionmaker, settings.retry_after_seconds)  # services' outage boundary
        grader_context = GraderContext.from_settings(settings, state_checks=registry.state_checks)
        stack.push_async_callback(grader_context.aclose)
        grading = build_grading(
            settings,
            registry,
            grader_context,
            store=store,
            database=database,
            metrics=metrics,
            tracing=tracing,
        )
        call_service = _call_service(stack, settings, registry, store, writer, metrics, tracing)
        # The same calls over MCP (Streamable HTTP at /mcp), through the same call service.
        mcp = McpHttp(registry, call_service, keyring, settings)
        remote, user = await _start_remote(
            stack, settings, registry, call_service, grading, database, tracing
        )
        if settings.user_tool and user is not None:
            call_service.conversations = UserToolConversations(
                user, registry, database, wait_seconds=settings.user_timeout_seconds + 5
            )
        await stack.enter_async_context(mcp.running())
        _freeze_startup_objects()
        yield AppState(
            settings=settings,
            registry=registry,
            keyring=keyring,
            metrics=metrics,
            engine=engine,
            sessionmaker=sessionmaker,
            store=store,
            log_writer=writer,
            grading=grading,
            call_service=call_service,
            mcp=mcp,
            remote=remote,
            user=user,
        )


def _check_episode_names(settings: Settings, registry: Registry) -> None:
    """The episode protocols' reserved names: `submit` (both), the root's path segments (ORS)."""
    if settings.env_protocols:
        check_submit_is_free(registry)
    if "ors" in settings.env_protocols:
        check_pack_names(registry.packs)


def _open_store(stack: AsyncExitStack, settings: Settings) -> RolloutStore:
    """The rollout store, closed with the stack; a memory store warns that it serves one process only."""
    store = build_store(settings)
    stack.push_async_callback(store.aclose)
    if store.kind == "memory":
        log.warning(
            "rollout state is in memory: run exactly one worker process "
            "(set SPARRING_REDIS_URL to share state between workers and replicas)"
        )
    return store


def _start_tracing(stack: AsyncExitStack, settings: Settings, metrics: Metrics) -> Tracing | None:
    """The span exporter when tracing is on (app/telemetry.py), flushed and stopped last."""
    tracing = build_tracing(settings, metrics.trace_spans_dropped.inc)
    if tracing is not None:
        # In a thread: the last export may wait for a slow collector (5 s at most, app/telemetry.py).
        stack.push_async_callback(anyio.to_thread.run_sync, tracing.shutdown)
        log.info("tracing: spans go to the OTLP/HTTP collector (OTEL_EXPORTER_OTLP_*)")
    return tracing


async def _start_partition_upkeep(stack: AsyncExitStack, engine: AsyncEngine) -> None:
    """Postgres: the call log's partitions made ahead now, then hourly (app/db/partitions.py)."""
    if engine.dialect.name != "postgresql":
        return
    await upkeep_round(engine)
    task = asyncio.create_task(keep_partitions(engine), name="call-log-partitions")

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    stack.push_async_callback(stop)


def _start_log_writer(
    stack: AsyncExitStack, engine: AsyncEngine, settings: Settings, metrics: Metrics
) -> CallLogWriter:
    """The call-log writer, started now and drained when the stack closes."""
    writer = CallLogWriter(
        engine,
        metrics=metrics,
        queue_size=settings.log_queue_size,
        batch_size=settings.log_batch_size,
        retry_after=settings.retry_after_seconds,
    )
    writer.start()
    stack.push_async_callback(writer.aclose)
    return writer


def _call_service(
    stack: AsyncExitStack,
    settings: Settings,
    registry: Registry,
    store: RolloutStore,
    writer: CallLogWriter,
    metrics: Metrics,
    tracing: Tracing | None,
) -> ToolCallService:
    """The one call service (HTTP and MCP), closed before the log writer it corrects the log through."""
    call_service = ToolCallService(
        registry=registry,
        store=store,
        log_writer=writer,
        worker=worker_name(settings),
        max_output_bytes=settings.max_output_bytes,
        tool_timeout=settings.tool_timeout_seconds,
        metrics=metrics,
        tracing=tracing,
        retry_after=settings.retry_after_seconds,
    )
    stack.push_async_callback(call_service.aclose)  # its log corrections, while the writer still runs
    return call_service


async def _start_remote(
    stack: AsyncExitStack,
    settings: Settings,
    registry: Registry,
    call_service: ToolCallService,
    grading: GradingService,
    database: Database,
    tracing: Tracing | None,
) -> tuple[RemoteRolloutService, SimulatedUser | None]:
    """The remote rollouts and the model HTTP client they use, started now, and the simulated user
    (SPARRING_USER_MODEL) on that client, which remote rollouts and episodes share.

    Remote rollouts stop first: stopping them records them as errors, which needs the database."""
    model_http = build_model_http(settings)
    stack.push_async_callback(model_http.aclose)
    user = build_user(settings, model_http)
    remote = build_remote(
        settings,
        registry=registry,
        calls=call_service,
        grading=grading,
        database=database,
        model_http=model_http,
        worker=worker_name(settings),
        tracing=tracing,
        user=user,
    )
    stack.push_async_callback(remote.aclose)
    await remote.start()
    return remote, user
