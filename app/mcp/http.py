"""MCP over Streamable HTTP at /mcp: the SDK's transport in stateless mode, behind sparring's keys.

Stateless, so any replica answers any request: the SDK keeps nothing between requests, the session's
identity travels in the `Mcp-Session-Id` header (minted here, on the answer to a request that came
without one, which the client then sends with every request) and its state is the rollout's, in
the rollout store. One session is one rollout: `trace_mcp_<session id>`, unless the client names
its own with `X-Sparring-Trace-Id`; the run label is `X-Sparring-Run` (default `production`).

The session is a handshake-era notion (protocol revisions up to 2025-11-25): a request of the
2026-07-28 revision, which has no session, is refused with the protocol's own -32022 error naming
the revisions served, and the SDK's client then falls back to the handshake.

`/packs/<pack>/mcp` is the same endpoint showing one pack's tools (its shared names included), as
`/packs/<pack>/tools/<name>` serves them: a client connected for one environment sees only its tools.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from app.auth import KeyRing
from app.calls.service import ToolCallService
from app.config import Settings
from app.errors import NotFound, SparringError, json_response
from app.mcp.server import Caller, McpGateway
from app.packs import Registry
from app.rollouts.identity import RUN_HEADER, fit

log = logging.getLogger(__name__)

PATH = "/mcp"
_PACKS_PREFIX = "/packs/"
SESSION_HEADER = "mcp-session-id"
TRACE_HEADER = "x-sparring-trace-id"
DEFAULT_RUN = "production"
SESSION_MAX = 64  # a minted id is 32 hex digits; a longer one sent by a client is cut with a hash

CALLER_KEY = "sparring.mcp.caller"  # scope keys: who calls, and a failure the answer's status shows
FAILURE_KEY = "sparring.mcp.failure"

_LOOPBACK_HOSTS = ["127.0.0.1:*", "localhost:*", "[::1]:*", "127.0.0.1", "localhost", "[::1]"]
_LOOPBACK_ORIGINS = ["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"]


def transport_security(settings: Settings) -> TransportSecuritySettings:
    """The SDK's DNS-rebinding checks (Host and Origin headers) for the hosts this server answers as.

    Loopback, the public base URL and SPARRING_MCP_ALLOWED_HOSTS / _ORIGINS are allowed. A server
    bound to a non-loopback address with no allowed host (nor a public base URL) cannot know its own
    names: the checks are off there, the Origin check with the Host check (the SDK has them on or off
    together; its API keys still apply), and the start-up log says so, naming origins set in vain.
    """
    hosts = list(settings.mcp_allowed_hosts)
    origins = list(settings.mcp_allowed_origins)
    if settings.public_base_url:
        parts = urlsplit(settings.public_base_url)
        if parts.netloc:
            hosts.append(parts.netloc)
            origins.append(f"{parts.scheme}://{parts.netloc}")
    if not hosts and not settings.binds_loopback:
        log.warning(
            "MCP Host/Origin checks are off%s: set SPARRING_PUBLIC_BASE_URL or SPARRING_MCP_ALLOWED_HOSTS "
            "to the names this server is reached by",
            " (SPARRING_MCP_ALLOWED_ORIGINS is not applied without an allowed host)" if origins else "",
        )
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[*_LOOPBACK_HOSTS, *hosts],
        allowed_origins=[*_LOOPBACK_ORIGINS, *origins],
    )


def _caller_of(ctx: ServerRequestContext[Any, Any]) -> Caller:
    request = ctx.request
    caller = request.scope.get(CALLER_KEY) if isinstance(request, Request) else None
    if not isinstance(caller, Caller):
        raise RuntimeError("an MCP request reached the tools without passing sparring's endpoint")
    return caller


def _note_failure(ctx: ServerRequestContext[Any, Any], exc: SparringError) -> None:
    if isinstance(ctx.request, Request):
        ctx.request.scope[FAILURE_KEY] = exc


class McpHttp:
    """The ASGI endpoint of /mcp (one per app, built by the lifespan, run inside it)."""

    def __init__(
        self, registry: Registry, service: ToolCallService, keyring: KeyRing, settings: Settings
    ) -> None:
        self.keyring = keyring
        self.registry = registry
        self.gateway = McpGateway(
            registry,
            service,
            _caller_of,
            retry_after=settings.retry_after_seconds,
            on_failure=_note_failure,
        )
        self.manager = StreamableHTTPSessionManager(
            app=self.gateway.server,
            json_response=True,  # one JSON answer per request: nothing streams from these tools
            stateless=True,
            security_settings=transport_security(settings),
            max_request_body_size=settings.max_body_bytes,
        )

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        async with self.manager.run():
            yield

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        pack = mcp_pack(scope)
        try:
            self.keyring.authorize(request, "tools")
            if pack is not None and pack not in self.registry.pack_tools:
                enabled = ", ".join(self.registry.pack_tools) or "none"
                raise NotFound(f"no enabled pack named {pack!r} (enabled: {enabled})")
        except SparringError as exc:
            await json_response(exc.body(), exc.status_code, exc.headers())(scope, receive, send)
            return
        if scope["method"] == "GET":
            # No stream to offer: stateless, the server never sends a message of its own. An idle
            # stream per client would only hold a connection (and a restart) open; 405 is the spec's
            # way to say so, and the client stops asking.
            await Response(status_code=405, headers={"Allow": "POST, DELETE"})(scope, receive, send)
            return
        headers = request.headers
        version = headers.get("mcp-protocol-version")
        if version in MODERN_PROTOCOL_VERSIONS:
            await _sessionless_refusal(version)(scope, receive, send)
            return
        sent = headers.get(SESSION_HEADER)
        session = fit(sent, SESSION_MAX) if sent else uuid.uuid4().hex
        trace = headers.get(TRACE_HEADER)
        scope[CALLER_KEY] = Caller(
            # As sent: the call service keys it (`trace_key`) as the tool routes and graders do; cut
            # here too, a long id would be cut twice, into another rollout than theirs.
            trace_id=trace or f"trace_mcp_{session}",
            run=headers.get(RUN_HEADER) or DEFAULT_RUN,
            session=session,
            pack=pack,
        )
        minted = None if sent else session.encode()

        async def answer(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra: list[tuple[bytes, bytes]] = []
                if minted is not None:
                    extra.append((SESSION_HEADER.encode(), minted))
                failure = scope.get(FAILURE_KEY)
                if isinstance(failure, SparringError):
                    # The JSON-RPC error in the body is for MCP clients; the status is for HTTP
                    # layers (a trainer's retry policy, a proxy): 503 + Retry-After, or 500.
                    message = {**message, "status": failure.status_code}
                    extra.extend((k.lower().encode(), v.encode()) for k, v in failure.headers().items())
                if extra:
                    message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.manager.handle_request(scope, receive, answer)


def _sessionless_refusal(requested: str) -> Response:
    error = types.JSONRPCError(
        jsonrpc="2.0",
        id=None,
        error=types.ErrorData(
            code=types.UNSUPPORTED_PROTOCOL_VERSION,
            message=(
                f"protocol {requested} has no sessions, and an MCP session is a sparring rollout: "
                "use the initialize handshake"
            ),
            data=types.UnsupportedProtocolVersionErrorData(
                supported=list(HANDSHAKE_PROTOCOL_VERSIONS), requested=requested
            ).model_dump(by_alias=True),
        ),
    )
    return Response(
        error.model_dump_json(by_alias=True, exclude_unset=True),
        status_code=400,
        media_type="application/json",
    )


def is_mcp_request(scope: Scope) -> bool:
    """Whether the request is for /mcp or /packs/<pack>/mcp (under the app's root path, if any)."""
    return scope["type"] == "http" and _mcp_path(scope) is not None


def mcp_pack(scope: Scope) -> str | None:
    """The pack an MCP request's path names (`/packs/<pack>/mcp`), None for `/mcp`."""
    found = _mcp_path(scope)
    return found[0] if found else None


def _mcp_path(scope: Scope) -> tuple[str | None] | None:
    """(the pack named, or None) of an MCP path; None for any other path."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        path = path[len(root) :]
    if path == PATH:
        return (None,)
    if path.startswith(_PACKS_PREFIX) and path.endswith(PATH):
        pack = path[len(_PACKS_PREFIX) : -len(PATH)]
        if pack and "/" not in pack:
            return (pack,)
    return None
