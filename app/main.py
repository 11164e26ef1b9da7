"""create_app(): routers, middleware and the error handler."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from redis.exceptions import RedisError
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from app.auth import require
from app.calls.routes import ToolCallFastPath
from app.calls.routes import router as tools_router
from app.config import Settings, get_settings
from app.errors import ServiceUnavailable, SparringError, handle_outage, handle_sparring_error
from app.grading.routes import router as grading_router
from app.lifespan import AppOptions, lifespan
from app.middleware import BodyLimitMiddleware
from app.review.routes import router as review_router
from app.rollouts.routes import router as rollouts_router
from app.sdk import Pack


def create_app(settings: Settings | None = None, *, packs: list[Pack] | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        title="sparring",
        summary="Stateful tools and graders for agent reinforcement fine-tuning.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.settings = settings
    app.state.options = AppOptions(packs=tuple(packs) if packs is not None else None)
    app.add_exception_handler(SparringError, handle_sparring_error)
    app.add_exception_handler(SQLAlchemyError, handle_outage)
    app.add_exception_handler(RedisError, handle_outage)
    app.add_exception_handler(OSError, handle_outage)
    # The tool-call hot path (see app.calls.routes), inside the body limit: added first, so it runs after it.
    app.add_middleware(ToolCallFastPath)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz(request: Request) -> dict[str, str]:
        try:
            await request.app.state.store.ping()
            async with request.app.state.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except ServiceUnavailable:
            raise
        except Exception as exc:
            raise ServiceUnavailable(f"database unreachable: {type(exc).__name__}") from exc
        return {"status": "ready"}

    docs_guard: list[Any] = [] if settings.docs_public else [Depends(require("admin"))]

    @app.get("/openapi.json", include_in_schema=False, dependencies=docs_guard)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/docs", include_in_schema=False, dependencies=docs_guard)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="sparring API")

    @app.get("/metrics", include_in_schema=False, dependencies=[Depends(require("admin"))])
    async def metrics(request: Request) -> Response:
        body = request.app.state.metrics.exposition()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(tools_router)
    app.include_router(rollouts_router)
    app.include_router(grading_router)
    app.include_router(review_router)
    return app
