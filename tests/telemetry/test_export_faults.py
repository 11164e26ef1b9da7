"""A collector that is down, hangs or cannot keep up costs calls nothing: spans are dropped and counted."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ADMIN_KEY, AppFactory, call_body, make_settings, new_trace
from tests.telemetry.receiver import OtlpReceiver

pytestmark = pytest.mark.parametrize("backend", ["embedded"])

DROPPED = "sparring_trace_spans_dropped_total"


async def dropped(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).text
    values = [float(line.split()[1]) for line in text.splitlines() if line.startswith(DROPPED + " ")]
    assert values, f"{DROPPED} is not in /metrics"
    return values[0]


async def dropped_reaches(client: httpx.AsyncClient, count: int, polls: int = 600) -> float:
    """The dropped-spans count once it is at least `count` (bounded polling; the export runs in a thread)."""
    value = await dropped(client)
    for _ in range(polls):
        if value >= count:
            return value
        await asyncio.sleep(0.05)
        value = await dropped(client)
    raise AssertionError(f"only {value} spans counted as dropped, expected {count}")


async def calls(client: httpx.AsyncClient, count: int) -> list[int]:
    trace = new_trace()
    answers = [
        await client.post("/tools/increment", json=call_body({}, trace_id=trace, call_id=f"c{n}"))
        for n in range(count)
    ]
    return [answer.status_code for answer in answers]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_dead_collector_fails_no_call_and_its_spans_are_counted_as_dropped(
    traced_app: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    async with traced_app(otel_exporter_otlp_endpoint=f"http://127.0.0.1:{closed_port()}") as client:
        assert await dropped(client) == 0
        assert await calls(client, 3) == [200, 200, 200]
        await dropped_reaches(client, 3)


async def test_calls_are_answered_while_the_collector_hangs_and_a_full_queue_drops_spans(
    traced_app: AppFactory, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "1")
    receiver.hold()
    async with traced_app() as client:
        assert await calls(client, 1) == [200]
        for _ in range(600):  # the exporter's thread has posted the first span and waits for an answer
            if receiver.holding.is_set():
                break
            await asyncio.sleep(0.05)
        assert receiver.holding.is_set()
        # Still waiting on the collector: ten more calls are answered, and the queue keeps only four spans.
        assert await calls(client, 10) == [200] * 10
        assert receiver.holding.is_set() and receiver.spans == []
        assert await dropped(client) >= 6
        # The held export times out: its span is dropped too.
        await dropped_reaches(client, 7)
        receiver.release()


async def test_shutting_down_waits_for_a_hanging_collector_a_few_seconds_only(
    backend: str, receiver: OtlpReceiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last export may hang on a collector that does not answer: shutdown gives it a few seconds,
    not the exporter's timeout (which held a stopping server for up to 30 s)."""
    from app.telemetry import build_tracing

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "30")
    receiver.hold()
    settings = make_settings(tmp_path, otel_exporter_otlp_endpoint=receiver.url)
    lost: list[int] = []
    tracing = build_tracing(settings, lost.append)
    assert tracing is not None
    tracing.tracer.start_span("a span").end()
    try:
        assert await asyncio.to_thread(receiver.holding.wait, 30)  # the export waits for an answer
        started = time.monotonic()
        await asyncio.to_thread(tracing.shutdown)
        assert time.monotonic() - started < 10
    finally:
        receiver.release()


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"OTEL_BSP_MAX_QUEUE_SIZE": "0"}, "OTEL_BSP_MAX_QUEUE_SIZE"),
        ({"OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "500"}, "OTEL_BSP_"),
    ],
)
async def test_batching_the_sdk_refuses_fails_the_start_in_a_line(
    backend: str,
    traced_app: AppFactory,
    monkeypatch: pytest.MonkeyPatch,
    variables: dict[str, str],
    named: str,
) -> None:
    """OTEL_BSP_* values the SDK refuses: a StartupError naming the variables (the one line `sparring
    serve` prints), not the SDK's ValueError and its traceback."""
    from app.errors import StartupError

    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StartupError, match=named):
        async with traced_app():
            pass
