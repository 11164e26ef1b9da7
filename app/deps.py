"""The app's typed state (built by the lifespan) and the small dependencies that read it.

This module is the only reader of `app.state`: everything else gets its resources through
`app_state(app)` or a dependency below. The dependencies are `async def` on purpose: FastAPI runs a
plain `def` dependency in its thread pool, a thread hand-off per dependency per request.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request, Response
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor

from app.auth import KeyRing
from app.calls.log_writer import CallLogWriter
from app.calls.service import ToolCallService
from app.config import Scope, Settings
from app.db.session import Database as Database  # re-exported: routes name their sessions by it
from app.db.text import has_control_character
from app.errors import BadRequest, handle_sparring_error, outage
from app.grading.service import GradingService
from app.mcp.http import McpHttp
from app.metrics import Metrics
from app.packs import Registry
from app.remote.service import RemoteRolloutService
from app.rollouts.store import RolloutStore
from sparring.usersim import SimulatedUser
from sparring.wire import path_trace_key

_STATE = "sparring"  # the one name under app.state


@dataclass
class AppState:
    """Everything the lifespan builds; one per app, alive from start-up to shutdown."""

    settings: Settings
    registry: Registry
    keyring: KeyRing
    metrics: Metrics
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    store: RolloutStore
    log_writer: CallLogWriter
    grading: GradingService
    call_service: ToolCallService  # the one entry of a tool call: HTTP, MCP and the runner call it
    mcp: McpHttp  # /mcp: the registry over MCP, through call_service
    remote: RemoteRolloutService  # remote rollouts (eval-protocol): in the background, kept in the database
    user: SimulatedUser | None = None  # the simulated user of episodes (SPARRING_USER_MODEL; app/users)


def set_app_state(app: Starlette, state: AppState | None) -> None:
    setattr(app.state, _STATE, state)


def set_startup_failure(app: Starlette, message: str) -> None:
    """What stopped the lifespan, in the words of its StartupError (the setting and the fix)."""
    app.state.sparring_startup_failure = message


def startup_failure(app: Starlette) -> str | None:
    failure = getattr(app.state, "sparring_startup_failure", None)
    return failure if isinstance(failure, str) else None


def app_state(app: Starlette) -> AppState:
    """The state the lifespan built (RuntimeError before start-up); every tool call reads it once."""
    state: AppState | None = getattr(app.state, _STATE, None)
    if state is None:
        raise RuntimeError("the app has not started: its lifespan builds its state")
    return state


def started_state(app: Starlette) -> AppState | None:
    """The state the lifespan built, or None before start-up (for routes that answer either way)."""
    state: AppState | None = getattr(app.state, _STATE, None)
    return state


def retry_after(app: Starlette) -> int:
    """Retry-After of a 503; the default before start-up."""
    state: AppState | None = getattr(app.state, _STATE, None)
    return state.settings.retry_after_seconds if state is not None else 2


async def handle_outage(request: Request, exc: Exception) -> Response:
    """A database or Redis error that escaped a route: the dependency is down, so 503, never 500."""
    return await handle_sparring_error(request, outage(exc, retry_after(request.app)))


def database(app: Starlette) -> Database:
    """The database boundary (app/db/session.py) on the app's current session factory."""
    state = app_state(app)
    return Database(state.sessionmaker, state.settings.retry_after_seconds)


class TraceIdConvertor(Convertor[str]):
    """`{trace_id:trace}`: a trace id in a path, whole, given to the route as its stored key. It may hold
    "/" (escaped in the pages' links, decoded before routing), and a control character is the 400 of
    `reject_control_characters`, not "no route" (`:path` matches no line break). An id too long for
    the column is the id the calls sent, so it names the rollout its calls were logged under. One with a
    control character stays whole for that 400 (keyed, its tail would be hashed out of sight)."""

    regex = r"[\s\S]+"

    def convert(self, value: str) -> str:
        return value if has_control_character(value) else path_trace_key(value)

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("trace", TraceIdConvertor())


def reject_control_characters(request: Request) -> None:
    """A dependency of the admin routes: a filter or id holding NUL, CR, LF or another control
    character is a 400.

    No run label, item key, tool, grader, flag, cursor or trace_id the server stores holds one (the
    database cannot hold NUL, a header cannot hold CR or LF), so such a value is a mistake or an attack,
    not a lookup for the database to fail on (a 503).
    """
    values = [*request.query_params.values(), *(str(v) for v in request.path_params.values())]
    if any(has_control_character(value) for value in values):
        raise BadRequest("a filter or id contains a control character (NUL, CR, LF, ...)")


def require(scope: Scope) -> Callable[[Request], Coroutine[Any, Any, Scope]]:
    """A dependency that authorizes the request for `scope` (admin keys pass everywhere)."""

    async def dependency(request: Request) -> Scope:
        return app_state(request.app).keyring.authorize(request, scope)

    return dependency


async def get_registry(request: Request) -> Registry:
    return app_state(request.app).registry


async def get_store(request: Request) -> RolloutStore:
    return app_state(request.app).store


async def get_database(request: Request) -> Database:
    return database(request.app)


async def get_grading(request: Request) -> GradingService:
    return app_state(request.app).grading


async def get_remote(request: Request) -> RemoteRolloutService:
    return app_state(request.app).remote


RegistryDep = Annotated[Registry, Depends(get_registry)]
StoreDep = Annotated[RolloutStore, Depends(get_store)]
DatabaseDep = Annotated[Database, Depends(get_database)]
GradingDep = Annotated[GradingService, Depends(get_grading)]
RemoteDep = Annotated[RemoteRolloutService, Depends(get_remote)]
ToolsKey = Annotated[Scope, Depends(require("tools"))]
GraderKey = Annotated[Scope, Depends(require("grader"))]
AdminKey = Annotated[Scope, Depends(require("admin"))]
