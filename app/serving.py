"""uvicorn's HTTP/1.1 protocols with deadlines on reading a request, for `sparring serve`.

uvicorn closes a keep-alive connection that stays idle after a response (`timeout_keep_alive`), but it
waits without limit for a fresh connection's first request, for a request's headers and for its body:
a client sending a byte a second holds a connection (and its memory) for as long as it likes. Here a
connection must deliver a request's headers within `SPARRING_HEADER_TIMEOUT_SECONDS` of being opened
or of the request's first byte, else it is closed; once the headers are in, the whole body must arrive
within `SPARRING_BODY_TIMEOUT_SECONDS`, else the client gets a 408 (if the app has not started to
answer) and the connection is closed.

The per-request cost is one timer at most, and none for a request whose headers and body come in one
read (a tool call usually does): the timer is armed only when a read leaves a request incomplete.
"""

from __future__ import annotations

import asyncio
from importlib.util import find_spec
from typing import Any

import h11
import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol

from app.config import get_settings

_IDLE, _HEADERS, _BODY = 0, 1, 2


def _timeout_answer(seconds: float) -> bytes:
    body = orjson.dumps(
        {
            "error": {
                "code": "request_timeout",
                "message": f"the request body did not arrive within {seconds:g} s",
            }
        }
    )
    head = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    )
    return head + body


class _ReadDeadline:
    """The timer shared by both protocols: `_phase` is what the connection waits for from the client."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any
    _deadline: asyncio.TimerHandle | None = None
    _phase: int = _IDLE

    # The mixin stands before uvicorn's protocol in the class's bases: `super()` is that protocol.
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._phase = _HEADERS  # a fresh connection owes its first request's headers
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        settings = get_settings()
        if self._phase == _HEADERS:
            seconds = settings.header_timeout_seconds
        else:
            seconds = settings.body_timeout_seconds
        self._deadline = self.loop.call_later(seconds, self._timed_out, self._phase, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _after_read(self) -> None:
        """Start the clock when a read left a request incomplete (and no clock runs for it yet)."""
        if self._phase != _IDLE and self._deadline is None and not self.transport.is_closing():
            self._arm()

    def _answer_started(self) -> bool:
        return self.cycle is not None and bool(self.cycle.response_started)

    def _timed_out(self, phase: int, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if phase == _BODY and not self._answer_started():
            self.transport.write(_timeout_answer(seconds))
        # The app, if it is waiting for the body, sees the client disconnect.
        self.transport.close()


if find_spec("httptools") is not None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsReadDeadlineProtocol(_ReadDeadline, HttpToolsProtocol):
        """uvicorn's httptools protocol; the parser's callbacks mark the phases of each request."""

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._after_read()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._phase = _HEADERS

        def on_headers_complete(self) -> None:
            self._disarm()
            self._phase = _BODY
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            self._phase = _IDLE
            super().on_message_complete()

        def handle_websocket_upgrade(self) -> None:
            self._disarm()
            self._phase = _IDLE
            super().handle_websocket_upgrade()


class H11ReadDeadlineProtocol(_ReadDeadline, H11Protocol):
    """uvicorn's h11 protocol; h11's state after each read tells the phase."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            phase = _BODY
        elif state is h11.IDLE and self.conn.trailing_data[0]:
            phase = _HEADERS  # part of a request line or of its headers is buffered
        else:
            phase = _IDLE
        if phase != self._phase:
            self._disarm()
            self._phase = phase
        self._after_read()


def http_protocol() -> str:
    """The protocol `sparring serve` gives uvicorn: httptools when installed (as uvicorn's "auto")."""
    if find_spec("httptools") is not None:
        return f"{__name__}:HttpToolsReadDeadlineProtocol"
    return f"{__name__}:H11ReadDeadlineProtocol"
