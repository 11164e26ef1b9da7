"""MCP clients of the official SDK, on an app in this process (both backends) or on a server's URL."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.conftest import ADMIN_KEY, TOOLS_KEY

SESSION_HEADER = "mcp-session-id"


class Sessions:
    """The `Mcp-Session-Id` values the server minted, in the order it answered them."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    async def __call__(self, response: httpx2.Response) -> None:
        minted = response.headers.get(SESSION_HEADER)
        if minted and minted not in self.ids:
            self.ids.append(minted)

    @property
    def trace(self) -> str:
        assert len(self.ids) == 1, self.ids
        return f"trace_mcp_{self.ids[0]}"


@asynccontextmanager
async def mcp_client(
    url: str,
    *,
    key: str | None = TOOLS_KEY,
    headers: dict[str, str] | None = None,
    transport: httpx2.AsyncBaseTransport | None = None,
    sessions: Sessions | None = None,
) -> AsyncIterator[Client]:
    """The SDK's `Client` over Streamable HTTP, with sparring's key (and any extra headers)."""
    sent = dict(headers or {})
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    hooks: dict[str, list[Callable[..., Any]]] = {"response": [sessions]} if sessions is not None else {}
    options: dict[str, Any] = {"headers": sent, "event_hooks": hooks, "timeout": 30.0}
    if transport is not None:
        options["transport"] = transport
    async with (
        httpx2.AsyncClient(**options) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        yield client


def in_process(app: Any) -> httpx2.AsyncBaseTransport:
    """An httpx2 transport that hands requests to the app in this process (its lifespan already runs)."""
    return httpx2.ASGITransport(app=app)


async def rollout(client: httpx.AsyncClient, trace: str) -> dict[str, Any]:
    """GET /rollouts/{trace} with the admin key: the rollout and its logged calls in order."""
    r = await client.get(f"/rollouts/{trace}", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def text_of(result: Any) -> str:
    """The one text block of a CallToolResult."""
    [block] = result.content
    assert block.type == "text"
    return str(block.text)
