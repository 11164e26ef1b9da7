"""Tracing fixtures: a real OTLP/HTTP receiver on loopback, and apps that export their spans to it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from app.deps import app_state
from tests.conftest import AppFactory
from tests.runner.conftest import model_server, model_server_process, openai_client

__all__ = ["model_server", "model_server_process", "openai_client"]  # the scripted model's fixtures
from tests.telemetry.receiver import OtlpReceiver, otlp_receiver


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    # The SDK reads its batching from the environment: export every 50 ms instead of every 5 s.
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    with otlp_receiver() as running:
        yield running


@pytest.fixture
def traced_app(app_factory: AppFactory, receiver: OtlpReceiver) -> AppFactory:
    """The app factory with OTEL_EXPORTER_OTLP_ENDPOINT pointing at the receiver."""

    @asynccontextmanager
    async def factory(*args: Any, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
        overrides.setdefault("otel_exporter_otlp_endpoint", receiver.url)
        async with app_factory(*args, **overrides) as client:
            yield client

    return factory


async def flush(client: httpx.AsyncClient) -> None:
    """Export what the app's batch processor holds now (the SDK's force_flush, off the event loop)."""
    tracing = app_state(client.app).call_service.tracing  # type: ignore[attr-defined]
    assert tracing is not None
    await asyncio.to_thread(tracing.provider.force_flush)


def traceparent(trace_id: str | None = None, span_id: str | None = None) -> tuple[str, str, str]:
    """A W3C traceparent header value with fresh ids, and the ids."""
    trace_id = trace_id or os.urandom(16).hex()
    span_id = span_id or os.urandom(8).hex()
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id
