"""create_app(): routers, middleware and the error handler."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import RedirectResponse
from sqlalchemy import text
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from app.calls.routes import NOT_A_TOOL_CALL, TOOL_SCOPE_KEY, serve_tool_call, tool_call_target
from app.calls.routes import router as tools_router
from app.config import Settings, get_settings
from app.deps import app_state, database, handle_outage, require, started_state, startup_failure
from app.episodes.openenv import openenv_router
from app.episodes.ors import ors_router
from app.errors import (
    OUTAGES,
    SparringError,
    handle_http_error,
    handle_sparring_error,
    handle_unexpected_error,
    handle_validation_error,
)
from app.grading.routes import router as grading_router
from app.lifespan import build_lifespan
from app.mcp.http import is_mcp_request
from app.middleware import BodyLimitMiddleware
from app.remote.routes import remote_router
from app.review.routes import router as review_router
from app.review.session import has_session, require_review_access
from app.rollouts.routes import router as rollouts_router
from app.sdk import Pack
from app.telemetry import TraceParent


class SparringApp(FastAPI):
    """The FastAPI app, with tool calls answered ahead of its middleware stack.

    `POST /tools` and `POST /tools/{name}` are the hot path of training: they go through the body
    limit to `serve_tool_call` directly, skipping the app's error, telemetry and routing layers
    (which cost more per call than the call's Redis work). `/mcp` (the same calls over MCP) takes
    the same shortcut to its endpoint. Every other request, and the lifespan, goes through FastAPI
    as usual.
    """

    tool_calls: ASGIApp | None = None
    mcp_calls: ASGIApp | None = None
    startup_tracebacks = False  # SPARRING_DEBUG: a failed start-up logs its traceback, not one line

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" and not self.startup_tracebacks:
            send = self._brief_startup_failure(send)
        if self.tool_calls is not None:
            target = tool_call_target(scope)
            if target != NOT_A_TOOL_CALL:
                scope["app"] = self
                scope[TOOL_SCOPE_KEY] = target
                await self.tool_calls(scope, receive, send)
                return
        if self.mcp_calls is not None and is_mcp_request(scope):
            scope["app"] = self
            await self.mcp_calls(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def _brief_startup_failure(self, send: Send) -> Send:
        """`send`, with a start-up failure the lifespan explained (a StartupError: the setting and its fix)
        told in that one line instead of the traceback uvicorn would log."""

        async def brief_send(message: MutableMapping[str, Any]) -> None:
            failure = startup_failure(self)
            if message["type"] == "lifespan.startup.failed" and failure:
                message = {
                    **message,
                    "message": f"{failure} (SPARRING_DEBUG=1 or --debug shows the traceback)",
                }
            await send(message)

        return brief_send


async def serve_mcp(scope: Scope, receive: Receive, send: Send) -> None:
    """/mcp: the app's `McpHttp`, which the lifespan builds (app/mcp/http.py)."""
    await app_state(scope["app"]).mcp(scope, receive, send)


def create_app(
    settings: Settings | None = None,
    *,
    packs: list[Pack] | None = None,
    pack_settings: Mapping[str, Mapping[str, Any]] | None = None,
) -> FastAPI:
    settings = settings or get_settings()
    app = SparringApp(
        title="sparring",
        summary="Stateful tools and graders for agent reinforcement fine-tuning.",
        lifespan=build_lifespan(settings, tuple(packs) if packs is not None else None, pack_settings),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.startup_tracebacks = settings.debug
    _add_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.tool_calls = BodyLimitMiddleware(serve_tool_call, max_bytes=settings.max_body_bytes)
    # MCP (Streamable HTTP): the same tools through the same call service; see app/mcp/http.py.
    app.mcp_calls = BodyLimitMiddleware(serve_mcp, max_bytes=settings.max_body_bytes)
    if settings.tracing:  # a request's W3C traceparent parents its spans (app/telemetry.py)
        app.add_middleware(TraceParent)
        app.tool_calls = TraceParent(app.tool_calls)
        app.mcp_calls = TraceParent(app.mcp_calls)

    _add_health_routes(app)
    _add_docs_routes(app, settings)

    @app.get("/", include_in_schema=False)
    async def home() -> RedirectResponse:
        return RedirectResponse("/review", status_code=303)

    @app.get("/metrics", include_in_schema=False, dependencies=[Depends(require("metrics"))])
    async def metrics(request: Request) -> Response:
        body = app_state(request.app).metrics.exposition()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(tools_router)
    app.include_router(rollouts_router)
    app.include_router(grading_router)
    app.include_router(review_router)
    app.include_router(remote_router(settings))
    _mount_episode_protocols(app, settings)
    return app


def _mount_episode_protocols(app: FastAPI, settings: Settings) -> None:
    """The episode protocols (app/episodes), as SPARRING_ENV_PROTOCOLS says: the one place they are mounted.

    After every other router: ORS serves `/{env}/...` at the origin root, so sparring's own paths must
    match first (and no pack may be named like one of them: app/episodes/ors.py, RESERVED_SEGMENTS).
    """
    if "openenv" in settings.env_protocols:
        # OpenEnv (openenv 0.10's clients): one environment per pack at `<base>/openenv/<pack>`, before ORS.
        app.include_router(openenv_router())
    if "ors" in settings.env_protocols:
        app.include_router(ors_router())


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure answers the stable JSON error body (app/errors.py); outages are 503s."""
    app.add_exception_handler(SparringError, handle_sparring_error)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_error)
    app.add_exception_handler(Exception, handle_unexpected_error)
    for failure in OUTAGES:
        app.add_exception_handler(failure, handle_outage)


def _add_health_routes(app: FastAPI) -> None:
    """Liveness, and readiness: the rollout store and the database answer."""

    @app.get("/healthz", tags=["health"])
    async def healthz(request: Request) -> dict[str, Any]:
        """Liveness; packs whose resources report their health (`health()`) add it under `packs`
        (the code pack: whether its runs fork from a warm sandbox parent or start cold)."""
        answer: dict[str, Any] = {"status": "ok"}
        state = started_state(request.app)
        packs: dict[str, Any] = {}
        for name, resources in (state.registry.resources if state is not None else {}).items():
            report = getattr(resources, "health", None)
            if callable(report):
                packs[name] = report()
        if packs:
            answer["packs"] = packs
        return answer

    @app.get("/readyz", tags=["health"])
    async def readyz(request: Request) -> dict[str, str]:
        await app_state(request.app).store.ping()
        async with database(request.app).session() as session:
            await session.execute(text("SELECT 1"))
        return {"status": "ready"}


def _add_docs_routes(app: FastAPI, settings: Settings) -> None:
    # The API docs: an admin key, or the review login (a reviewer's browser opens them).
    docs_guard: list[Any] = [] if settings.docs_public else [Depends(require_review_access)]

    @app.get("/openapi.json", include_in_schema=False, dependencies=docs_guard)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> Response:
        if not settings.docs_public and not await has_session(request):
            if settings.auth_header not in request.headers:
                return RedirectResponse("/review/login?next=/docs", status_code=303)
            await require_review_access(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="sparring API")
