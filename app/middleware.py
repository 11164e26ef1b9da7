"""ASGI middleware: cap request bodies before they are read (413), on Content-Length and while streaming."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(Exception):
    """Raised from `receive` once the body passed the limit; the middleware answers 413."""


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        # Not a coroutine itself when the body needs no counting: the server awaits the app's own.
        if scope["type"] != "http":
            return self.app(scope, receive, send)
        declared: int | None = None
        chunked = False
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
            elif name == b"transfer-encoding":
                chunked = True
        if declared is not None and declared > self.max_bytes:
            return self._reject(send, declared)
        if declared is not None and not chunked:
            # The server delivers exactly Content-Length bytes, already checked: nothing to count.
            return self.app(scope, receive, send)
        return self._counted(scope, receive, send)

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(send, received)

    async def _reject(self, send: Send, size: int) -> None:
        body: dict[str, Any] = {
            "error": {
                "code": "payload_too_large",
                "message": f"request body exceeds the limit of {self.max_bytes} bytes",
                "details": {"limit": self.max_bytes, "received_at_least": size},
            }
        }
        payload = orjson.dumps(body)
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
