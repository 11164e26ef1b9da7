"""Slow and idle clients against a real server: headers or a body trickled in, idle connections.

The server runs with 1 s deadlines; each raw connection must be closed by the server well within a
generous bound (10 s) while its client would need far longer to finish, and normal requests still work.
Runs twice: `sparring serve` (httptools) and uvicorn with the h11 variant of the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.system.helpers import HOST, TOOLS_HEADERS, Server, Servers, server_settings

pytestmark = pytest.mark.slow

BOUND = 10.0  # the server must have closed a connection by then; a client would need 30 s or more
TRICKLE = 0.3  # seconds between two bytes of a slow client
AUTH = TOOLS_HEADERS["Authorization"].encode()


class H11Server(Server):
    """uvicorn with the h11 variant of the protocol `sparring serve` uses (same deadlines)."""

    def command(self) -> list[str]:
        return [
            *super().command(),
            "--http",
            "app.serving:H11ReadDeadlineProtocol",
            "--timeout-keep-alive",
            self.settings["SPARRING_KEEPALIVE_TIMEOUT_SECONDS"],
        ]


@pytest.fixture(params=["serve", "h11"])
def flavour(request: pytest.FixtureRequest) -> Iterator[str]:
    yield str(request.param)


@pytest.fixture
async def server(flavour: str, servers: Servers, module_database: str, tmp_path: Path) -> Server:
    settings = server_settings(
        database_url=module_database,
        redis_url=None,
        home=tmp_path / "home",
        worker=f"slow-{flavour}",
        SPARRING_HEADER_TIMEOUT_SECONDS="1",
        SPARRING_BODY_TIMEOUT_SECONDS="1",
        SPARRING_KEEPALIVE_TIMEOUT_SECONDS="1",
    )
    if flavour == "serve":
        return await servers.start(flavour, settings, cli=True)
    started = H11Server(flavour, settings, servers.log_dir).start()
    servers.started.append(started)
    await started.wait_ready()
    return started


def call_body() -> bytes:
    trace = f"trace_slow_{uuid.uuid4().hex[:12]}"
    return orjson.dumps({"call_id": "c1", "trace_id": trace, "arguments": '{"by": 2}'})


def call_head(length: int) -> bytes:
    return (
        b"POST /tools/increment HTTP/1.1\r\nHost: sparring\r\nAuthorization: " + AUTH + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length
    )


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection; fails if it is still open at BOUND."""
    received = b""

    async def drain() -> None:
        nonlocal received
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                received += chunk

    try:
        await asyncio.wait_for(drain(), BOUND)
    except TimeoutError:
        pytest.fail(f"the server still holds the connection after {BOUND:g} s (received {received!r})")
    return received


async def trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Send `data` a byte at a time until done or the server hangs up."""
    with contextlib.suppress(ConnectionError):
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            await writer.drain()
            await asyncio.sleep(TRICKLE)


async def slow_connection(server: Server, sent_at_once: bytes, trickled: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(HOST, server.port)
    sender = None
    try:
        if sent_at_once:
            writer.write(sent_at_once)
            await writer.drain()
        sender = asyncio.create_task(trickle(writer, trickled))
        return await read_until_closed(reader)
    finally:
        if sender is not None:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_headers_sent_a_byte_at_a_time_are_cut_off(server: Server) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: sparring\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n"
    received = await slow_connection(server, b"", request)
    assert b"HTTP/1.1 200" not in received  # the request never completed


async def test_a_body_sent_a_byte_at_a_time_gets_408(server: Server) -> None:
    body = call_body()
    received = await slow_connection(server, call_head(len(body)), body)
    head, _, payload = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), received
    assert orjson.loads(payload)["error"]["code"] == "request_timeout"


async def test_an_idle_connection_is_closed(server: Server) -> None:
    received = await slow_connection(server, b"", b"")
    assert received == b""


async def test_an_idle_keep_alive_connection_is_closed_after_its_answer(server: Server) -> None:
    received = await slow_connection(server, b"GET /healthz HTTP/1.1\r\nHost: sparring\r\n\r\n", b"")
    assert received.startswith(b"HTTP/1.1 200 "), received
    assert received.count(b"HTTP/1.1 ") == 1


async def test_normal_requests_still_work(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url, headers=TOOLS_HEADERS, timeout=20) as client:
        for _ in range(3):  # one keep-alive connection, several requests
            assert (await client.get("/healthz")).status_code == 200
            answer = await client.post(
                "/tools/increment", content=call_body(), headers={"Content-Type": "application/json"}
            )
            assert answer.status_code == 200, answer.text
            assert "Error" not in answer.json()["output"]

    # Headers and body in separate writes, each well within its deadline.
    reader, writer = await asyncio.open_connection(HOST, server.port)
    try:
        body = call_body()
        head = call_head(len(body))
        writer.write(head[:20])
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(head[20:])
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(body + call_head(len(body)) + body)  # the second request is pipelined
        await writer.drain()
        received = b""
        async with asyncio.timeout(BOUND):
            while received.count(b"HTTP/1.1 200 ") < 2:
                chunk = await reader.read(65536)
                assert chunk, f"connection closed early: {received!r}"
                received += chunk
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
