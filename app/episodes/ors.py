"""The ORS front door (the Open Reward Standard: ors-sdk 0.1, openreward 0.1.167) at the origin root.

The SDKs join their paths (`/create_session`, `/<pack>/call`) to the origin, so ORS claims the first
path segment for pack names (`check_pack_names` refuses a pack named like one of sparring's own
segments). A session is one rollout, `trace_ors_<sid>_<hex>`; a `/call` is a tool call through the one call
service (channel `ors`), answered as a server-sent event stream; `submit(answer)`, the declared
terminal tool, grades the episode with the pack's grader. The key is the tools key in `X-API-Key`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from app.deps import AppState, app_state
from app.episodes.episode import (
    SUBMIT,
    SUBMIT_ARG,
    SUBMIT_DESCRIPTION,
    EpisodeFinished,
    call_tool,
    session_store,
    submit,
    tool_specs,
)
from app.episodes.sessions import SID_MAX, EpisodeSession
from app.episodes.tasks import TaskApiError, UnknownEnv, load_task_row, started_pack, task_router
from app.errors import (
    ServiceUnavailable,
    SparringError,
    StartupError,
    ToolCrashed,
    Unauthorized,
    json_response,
)
from app.packs import Registry
from app.rollouts.identity import JSON_DEPTH_MAX, RUN_HEADER, RUN_MAX, fit, nested_deeper_than, trace_key
from sparring.wire import new_call_id

log = logging.getLogger(__name__)

CHANNEL = "ors"
KEY_HEADER = "X-API-Key"
SESSION_HEADER = "X-Session-ID"

# sparring's own first path segments, and the ORS routes at the root: no pack may be named like one.
RESERVED_SEGMENTS = frozenset(
    {
        "tools", "user-tools", "grade", "mcp", "remote", "rollouts", "review", "export", "docs",
        "openapi.json", "healthz", "readyz", "metrics", "openenv", "create", "create_session", "delete",
        "delete_session", "ping", "list_environments",
    }
)  # fmt: skip

# How long a resumed `/call` (one carrying its `task_id`) waits for its answer before it starts the
# stream: an outage found by then is an HTTP 503 with Retry-After, which the SDK retries with the same
# `task_id` and counts against its retries (a stream that ends early resets its count, so an outage
# found after the stream started would be resumed forever). Longer than the call log's bound on a
# stalled database (log_writer.COMMIT_TIMEOUT_SECONDS), shorter than the SDK's 30 s read timeout. A new
# call starts its stream at once, `task_id` first: once its tool may have run, the client must hold the
# call id, or its retry would be a new call and run the tool again. Past the wait, the stream sends
# `: ping` comments until the answer comes.
FIRST_WAIT_SECONDS = 25.0
KEEPALIVE_SECONDS = 5.0
# An answer is sent as `chunk` events of at most this many characters, then `end`: aiohttp refuses an
# SSE line over 128 KiB, and an output may be 256 KiB.
CHUNK_CHARS = 16 * 1024
SUBMITTED = "Submitted: the episode has ended."


class SessionNotFound(TaskApiError):
    status_code = 404
    code = "session_not_found"

    def __init__(self) -> None:
        super().__init__("Active environment not found")


class SessionExists(TaskApiError):
    status_code = 400
    code = "session_exists"

    def __init__(self) -> None:
        super().__init__("Session already exists")


class BadOrsRequest(TaskApiError):
    status_code = 400
    code = "bad_request"


def check_pack_names(names: Iterable[str]) -> None:
    """Refuse to serve ORS at the root when a pack is named like one of sparring's own path segments."""
    clashes = sorted(name for name in names if name.lower() in RESERVED_SEGMENTS)
    if clashes:
        raise StartupError(
            f"pack {', '.join(map(repr, clashes))} is named like one of sparring's own paths, which ORS "
            "serves pack names beside at the root: rename the pack, or leave `ors` out of "
            "SPARRING_ENV_PROTOCOLS"
        )


async def require_ors_key(request: Request) -> None:
    """The tools key (or an admin key) in `X-API-Key`, the one header both ORS SDKs send; else 401."""
    presented = request.headers.get(KEY_HEADER, "").strip()
    scopes = app_state(request.app).keyring.scopes_of(presented) if presented else set()
    if not scopes & {"tools", "admin"}:
        raise Unauthorized(f"send the tools key in the {KEY_HEADER} header")


def _enabled_packs(request: Request) -> list[str]:
    return list(app_state(request.app).registry.packs)


def _sse(event: str, data: str) -> bytes:
    return f"event: {event}\ndata: {data}\n\n".encode()


def answer_frames(payload: dict[str, Any]) -> list[bytes]:
    """`payload` as `chunk` events and a closing `end`, whose data the client concatenates.

    orjson writes no raw line break, so every piece is one `data:` line; a piece never starts with
    whitespace, which the SDKs strip from the start of each line.
    """
    text = orjson.dumps(payload).decode()
    pieces: list[str] = []
    while len(text) > CHUNK_CHARS:
        cut = CHUNK_CHARS
        while cut < len(text) and text[cut].isspace():
            cut += 1
        pieces.append(text[:cut])
        text = text[cut:]
    return [*(_sse("chunk", piece) for piece in pieces), _sse("end", text)]


def _sid(request: Request) -> str:
    sid = request.headers.get(SESSION_HEADER, "").strip()
    if not sid or len(sid) > SID_MAX:
        raise BadOrsRequest(f"send the session id (at most {SID_MAX} characters) in {SESSION_HEADER}")
    return sid


def _run(request: Request) -> str:
    run = request.headers.get(RUN_HEADER)
    return fit(run, RUN_MAX) if run else CHANNEL


async def _json_body(request: Request) -> dict[str, Any]:
    body = await request.body()
    try:
        data = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise BadOrsRequest(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadOrsRequest("the body must be a JSON object")
    return data


async def _ors_session(services: AppState, sid: str) -> EpisodeSession | None:
    """The ORS session `sid` (None when unknown, closed, or another protocol's: OpenEnv keeps its
    sessions in the same store)."""
    session = await session_store(services).get(sid)
    return session if session is not None and session.channel == CHANNEL else None


async def _session(request: Request, env: str | None = None) -> EpisodeSession:
    """The request's session (404 when unknown, closed or, for an `env` route, not an episode of it)."""
    session = await _ors_session(app_state(request.app), _sid(request))
    if session is None or (env is not None and (not session.started or session.pack != env)):
        raise SessionNotFound
    return session


def default_env(services: AppState) -> str:
    """The pack of a `/create` naming none: SPARRING_ORS_DEFAULT_ENV, else the first pack with tasks."""
    if services.settings.ors_default_env:
        return services.settings.ors_default_env
    for name, pack in services.registry.packs.items():
        if pack.dataset_builder is not None:
            return name
    raise UnknownEnv("no enabled pack ships tasks: name the environment (env_name)")


async def _task_of(services: AppState, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The pack and the row a `/create` asks for: `task_spec`, or `split` and `index`."""
    has_task = body.get("task_spec") is not None
    if has_task == (body.get("split") is not None or body.get("index") is not None):
        raise BadOrsRequest("Provide either task_spec or both split and index, not both/neither")
    env = body.get("env_name") or default_env(services)
    if not isinstance(env, str):
        raise BadOrsRequest("env_name must be a string")
    started_pack(services.registry, env)
    if has_task:
        row = body["task_spec"]
        if not isinstance(row, dict):
            raise BadOrsRequest("task_spec must be a JSON object (a task row)")
        if nested_deeper_than(row):
            raise BadOrsRequest(f"task_spec nests more than {JSON_DEPTH_MAX} levels deep")
        return env, row
    split, index = body.get("split"), body.get("index")
    if not isinstance(split, str) or not isinstance(index, int) or isinstance(index, bool):
        raise BadOrsRequest("split must be a string and index an integer")
    return env, await load_task_row(services.registry, env, split, index)


def _tools_answer(registry: Registry, env: str, *, user: bool) -> dict[str, Any]:
    started_pack(registry, env)
    return {
        "tools": tool_specs(registry, env, user=user),
        "terminal_tool": {"name": SUBMIT, "arg": SUBMIT_ARG, "description": SUBMIT_DESCRIPTION},
    }


def _prompt(row: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The row's messages as ORS text blocks, the role in each block's `detail` (none when the row's
    `messages` is not a list)."""
    messages = (row or {}).get("messages")
    blocks = []
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):  # content parts: their text, in order
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        text = content if isinstance(content, str) else orjson.dumps(content).decode()
        blocks.append({"type": "text", "text": text, "detail": {"role": message.get("role")}})
    return blocks


def _output(
    text: str, session: EpisodeSession, call_id: str, is_error: bool, reward: float | None, finished: bool
) -> dict[str, Any]:
    metadata = {"trace_id": session.trace_id, "call_id": call_id, "is_error": is_error}
    return {
        "ok": True,
        "output": {
            "blocks": [{"type": "text", "text": text}],
            "metadata": metadata,
            "reward": reward,
            "finished": finished,
        },
    }


async def answer_call(
    services: AppState, session: EpisodeSession, name: str, arguments: Any, call_id: str
) -> dict[str, Any]:
    """The `end` payload of one `/call`: a step, or `submit`; `ok: false` once the episode has ended."""
    try:
        if name == SUBMIT:
            answer = arguments.get(SUBMIT_ARG) if isinstance(arguments, dict) else None
            if not isinstance(answer, str):
                text = f"Error: {SUBMIT} takes one argument, {SUBMIT_ARG!r}: your final answer as text"
                return _output(text, session, call_id, True, None, False)
            reward = await submit(services, session, answer, call_id=call_id)
            return _output(SUBMITTED, session, call_id, False, reward, True)
        step = await call_tool(services, session, name, arguments, call_id)
        return _output(step.output, session, call_id, step.is_error, None, False)
    except EpisodeFinished as exc:
        # `reason` is openreward's discriminator (its ToolCallError.reason); ors-sdk reads `error`.
        return {"ok": False, "error": f"episode_finished: {exc.message}", "reason": "episode_finished"}


async def _call_events(work: asyncio.Future[dict[str, Any]], call_id: str) -> AsyncIterator[bytes]:
    """`task_id`, keep-alive comments while the call runs, then its answer (or `error` for a crash).

    An outage after the stream started ends it without `end`: the SDK sends the call again with its
    `task_id`, which the ledger answers once the call has an answer.
    """
    yield _sse("task_id", call_id)
    while not work.done():
        await asyncio.wait({work}, timeout=KEEPALIVE_SECONDS)
        if not work.done():
            yield b": ping\n\n"
    if work.cancelled():
        return
    exc = work.exception()
    if exc is None:
        for frame in answer_frames(work.result()):
            yield frame
        return
    if isinstance(exc, ServiceUnavailable):
        return
    if not isinstance(exc, SparringError):  # a bug in sparring, not a crashed tool or grader
        log.error("an ORS call failed", exc_info=exc)
    cause = exc.__cause__ if isinstance(exc, ToolCrashed) and exc.__cause__ is not None else exc
    yield _sse("error", type(cause).__name__)


def _settled(work: asyncio.Future[Any]) -> None:
    # Retrieved, so an answer nobody waits for any more (the client left) is not reported as lost.
    if not work.cancelled():
        work.exception()


_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=_STREAM_HEADERS)


async def _open_session(request: Request, sid: str, pack: str, row: dict[str, Any] | None) -> None:
    """A new session `sid` on a new rollout, `trace_ors_<sid>_<hex>` (400 if `sid` is taken).

    The trace is fresh even when the session id is not: a client may use its own id again once it has
    deleted the session, and that episode must not continue the old one's state, ledger and log.
    """
    made = await session_store(app_state(request.app)).create(
        pack=pack,
        trace_id=trace_key(f"trace_ors_{sid}_{uuid.uuid4().hex}"),
        row=row,
        channel=CHANNEL,
        run=_run(request),
        sid=sid,
    )
    if made is None:
        raise SessionExists


def _session_routes(router: APIRouter) -> None:
    """create_session and create: a session, then its task."""

    @router.post("/create_session")
    async def create_session(request: Request) -> StreamingResponse:
        sid = str(uuid.uuid4())
        await _open_session(request, sid, "", None)  # a uuid4 already in use: not in this universe

        async def events() -> AsyncIterator[bytes]:
            yield _sse("task_id", sid)
            yield _sse("end", "")

        return _event_stream(events())

    @router.post("/create")
    async def create(request: Request) -> dict[str, str]:
        """Give the session its task (and so its rollout); X-Secrets and unknown fields are ignored."""
        services, sid = app_state(request.app), _sid(request)
        pack, row = await _task_of(services, await _json_body(request))
        sessions = session_store(services)
        session = await sessions.get(sid)
        if session is None:  # a session id the client made itself, as the reference server allows
            await _open_session(request, sid, pack, row)
            return {"sid": sid}
        session.pack, session.row = pack, row
        if session.channel != CHANNEL or not await sessions.start(session):
            raise SessionExists
        return {"sid": sid}


def _liveness_routes(router: APIRouter) -> None:
    """ping, delete and delete_session: the session kept alive, then ended."""

    @router.post("/ping")
    async def ping(request: Request) -> dict[str, str]:
        await _session(request)
        return {"status": "ok"}

    @router.post("/delete")
    @router.post("/delete_session")
    async def delete(request: Request) -> dict[str, str | None]:
        services, sid = app_state(request.app), request.headers.get(SESSION_HEADER, "").strip() or None
        if sid is not None and await _ors_session(services, sid) is not None:
            await session_store(services).close(sid)
        return {"sid": sid}


def _env_routes(router: APIRouter, running: set[asyncio.Future[Any]]) -> None:
    """tools, task_tools, prompt and call: the routes under `/{env}`."""

    @router.get("/{env}/tools")
    @router.get("/{env}/task_tools")
    async def tools(env: str, request: Request) -> Response:
        services = app_state(request.app)
        return json_response(_tools_answer(services.registry, env, user=services.user is not None))

    @router.get("/{env}/prompt")
    async def prompt(env: str, request: Request) -> Response:
        return json_response(_prompt((await _session(request, env)).row))

    @router.post("/{env}/call")
    async def call(env: str, request: Request) -> StreamingResponse:
        """One step (or `submit`), answered as events; a retry carrying `task_id` is the same call."""
        services = app_state(request.app)
        body = await _json_body(request)
        session = await _session(request, env)
        name = body.get("name")
        task_id = body.get("task_id")
        call_id = task_id if isinstance(task_id, str) and task_id else new_call_id()
        work = asyncio.ensure_future(
            answer_call(services, session, name if isinstance(name, str) else "", body.get("input"), call_id)
        )
        running.add(work)  # held until done, even when the client has gone
        work.add_done_callback(running.discard)
        work.add_done_callback(_settled)
        if call_id == task_id:  # a resumed call, whose id the client holds: an outage may be a 503
            await asyncio.wait({work}, timeout=FIRST_WAIT_SECONDS)
            if work.done() and not work.cancelled():
                failure = work.exception()
                if isinstance(failure, ServiceUnavailable):
                    raise failure  # a 503 with Retry-After; the SDK retries with the same task_id
        return StreamingResponse(
            _call_events(work, call_id), media_type="text/event-stream", headers=_STREAM_HEADERS
        )


def ors_router() -> APIRouter:
    """Every ORS route (the Task API included), each behind the ORS key check; mounted at the root."""
    router = APIRouter(tags=["ORS"], dependencies=[Depends(require_ors_key)])
    router.include_router(task_router(_enabled_packs))
    _session_routes(router)
    _liveness_routes(router)
    _env_routes(router, set())
    return router
