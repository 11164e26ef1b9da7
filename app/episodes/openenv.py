"""OpenEnv's front door: one environment per pack at `<base>/openenv/<pack>`.

openenv 0.10's clients take a base URL with a path (`EnvClient._set_base_url` appends `/ws`,
`MCPToolClient` appends `/mcp`), so each pack is its own environment under this mount:

- `GET health`, `GET metadata`, `GET schema`;
- `WS ws[?session_id=]`: `reset` / `step` / `state` / `close` frames, one frame back per request
  (openenv_steps.py says what each does);
- `POST mcp`: OpenEnv's own JSON-RPC dialect (`openenv/session/create`, `tools/list`, `tools/call`,
  `openenv/session/close`), not MCP Streamable HTTP (that is sparring's `/mcp`);
- the Task API (`list_environments`, `{env}/tasks`, ...; app/episodes/tasks.py).

A session is one rollout at a time (a reset starts the next); each step is a call through the one
call service, logged on channel `openenv` with the `X-Sparring-Run` label (else `openenv`); `submit`
grades and ends the episode. Every route but `health` takes the tools key; a missing or bad key
refuses the WebSocket upgrade (403) and answers `/mcp` with 401.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from importlib import metadata as importlib_metadata
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request, Response, WebSocket, WebSocketDisconnect

from app.deps import AppState, app_state, require
from app.episodes import episode
from app.episodes.episode import SUBMIT, SUBMIT_ARG, SUBMIT_DESCRIPTION
from app.episodes.openenv_steps import (
    EpisodeRefused,
    act,
    given_call_id,
    open_session,
    reset,
    reset_observation,
    run_label,
    session_of,
    state_of,
)
from app.episodes.sessions import EpisodeSession
from app.episodes.tasks import UnknownEnv, task_router
from app.errors import ServiceUnavailable, SparringError, answer_to, json_response
from app.rollouts.identity import RUN_HEADER
from sparring.wire import CALL_ID_META

log = logging.getLogger(__name__)

PREFIX = "/openenv/{pack}"
POLICY_VIOLATION = 1008  # a WebSocket closed before its upgrade is answered 403


def served_pack(request: Request, pack: str) -> str:
    """The mount's pack (404 if it is not enabled)."""
    if pack not in app_state(request.app).registry.packs:
        raise UnknownEnv(f"Environment {pack!r} not found")
    return pack


def openenv_router() -> APIRouter:
    """Every route of the mount; include it once in the app."""
    router = APIRouter(prefix=PREFIX, tags=["OpenEnv"])
    keyed = [Depends(require("tools")), Depends(served_pack)]

    @router.get("/health")
    async def health(pack: str, request: Request) -> dict[str, str]:
        served_pack(request, pack)
        return {"status": "healthy"}

    @router.get("/metadata", dependencies=keyed)
    async def metadata(pack: str) -> dict[str, Any]:
        return environment_metadata(pack)

    @router.get("/schema", dependencies=keyed)
    async def schema() -> dict[str, Any]:
        return SCHEMA

    @router.post("/mcp", dependencies=keyed)
    async def mcp(pack: str, request: Request) -> Response:
        return await answer_rpc(app_state(request.app), pack, request)

    @router.websocket("/ws")
    async def ws(websocket: WebSocket, pack: str, session_id: str | None = None) -> None:
        await serve_socket(websocket, pack, session_id)

    router.include_router(task_router(lambda request: [request.path_params["pack"]]), dependencies=keyed)
    return router


def environment_metadata(pack: str) -> dict[str, Any]:
    try:
        version = importlib_metadata.version("sparring")
    except importlib_metadata.PackageNotFoundError:
        version = "0"
    return {
        "name": pack,
        "description": (
            f"sparring's {pack!r} pack: its tools (list_tools) on one rollout per episode. Start an "
            'episode with reset({"split", "index"}) or reset({"task": row}); end it with '
            f'step(CallToolAction(tool_name="{SUBMIT}", arguments={{"{SUBMIT_ARG}": final_answer}})), '
            f"which is graded by the pack's grader (reward) and ends the episode (done). "
            f"{SUBMIT} is not in the tool list. {SUBMIT_DESCRIPTION}"
        ),
        "version": version,
        "terminal_tool": {"name": SUBMIT, "arg": SUBMIT_ARG, "description": SUBMIT_DESCRIPTION},
    }


_TEXT = {"type": "string"}
SCHEMA: dict[str, Any] = {
    "action": {
        "oneOf": [
            {
                "type": "object",
                "properties": {"type": {"const": "list_tools"}},
                "required": ["type"],
            },
            {
                "type": "object",
                "properties": {
                    "type": {"const": "call_tool"},
                    "tool_name": _TEXT,
                    "arguments": {"type": "object"},
                },
                "required": ["type", "tool_name"],
            },
        ]
    },
    "observation": {
        "type": "object",
        "properties": {
            "messages": {"type": "array"},
            "task_id": {},
            "trace_id": _TEXT,
            "tools": {"type": "array"},
            "tool_name": _TEXT,
            "result": {"type": ["object", "null"]},
            "error": {"type": ["object", "null"]},
        },
    },
    "state": {
        "type": "object",
        "properties": {
            "episode_id": {"type": ["string", "null"]},
            "step_count": {"type": "integer"},
            "trace_id": {"type": ["string", "null"]},
            "done": {"type": "boolean"},
            "reward": {"type": ["number", "null"]},
        },
    },
}


# --- the WebSocket ------------------------------------------------------------------------------


def _frame(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "data": data}


def _observed(
    observation: dict[str, Any], *, reward: float | None = None, done: bool = False, metadata: dict[str, Any]
) -> dict[str, Any]:
    """An observation frame; `metadata` is always an object (the client's models refuse null)."""
    data = {"observation": observation, "reward": reward, "done": done, "metadata": metadata}
    return _frame("observation", data)


def _error_frame(message: str, code: str) -> dict[str, Any]:
    return _frame("error", {"message": message, "code": code})


async def _socket_session(
    services: AppState, websocket: WebSocket, pack: str, session_id: str | None
) -> tuple[EpisodeSession, bool] | None:
    """The socket's session and whether the socket opened it; None to refuse the upgrade."""
    try:
        services.keyring.authorize(websocket, "tools")
    except SparringError:
        return None
    if pack not in services.registry.packs:
        return None
    if session_id is None:
        return await open_session(services, run_label(websocket.headers.get(RUN_HEADER))), True
    try:
        return await session_of(services, pack, session_id), False
    except EpisodeRefused:
        return None


async def serve_socket(websocket: WebSocket, pack: str, session_id: str | None) -> None:
    services = app_state(websocket.app)
    opened = await _socket_session(services, websocket, pack, session_id)
    if opened is None:
        await websocket.close(code=POLICY_VIOLATION)
        return
    session, owned = opened
    await websocket.accept()
    closing = False
    try:
        while not closing:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            raw = message.get("text") or message.get("bytes") or b""
            reply, closing = await _answer_frame(services, pack, session, websocket, raw)
            if reply is not None:
                await websocket.send_text(orjson.dumps(reply).decode())
    except WebSocketDisconnect:
        pass
    finally:
        if owned or closing:
            await episode.session_store(services).close(session.sid)
    if closing:
        # The client closes its end right after its `close` frame: its socket may be gone already.
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await websocket.close()


async def _answer_frame(
    services: AppState, pack: str, session: EpisodeSession, websocket: WebSocket, raw: str | bytes
) -> tuple[dict[str, Any] | None, bool]:
    """The reply to one frame, and whether the socket closes (a `close` frame)."""
    limit = services.settings.max_body_bytes
    if len(raw) > limit:  # characters or bytes: either way past the limit a request body has over HTTP
        # A row as large would be kept in the session and read back with every step.
        return _error_frame(
            f"the frame is larger than SPARRING_MAX_BODY_BYTES ({limit} bytes)", "VALIDATION_ERROR"
        ), False
    try:
        frame = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _error_frame("the frame is not JSON", "INVALID_JSON"), False
    if not isinstance(frame, dict):
        return _error_frame('a frame is an object {"type", "data"}', "VALIDATION_ERROR"), False
    kind, data = frame.get("type"), frame.get("data")
    if kind == "close":
        return None, True
    handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
    if handler is None:
        return _error_frame(f"unknown frame type {kind!r}", "UNKNOWN_TYPE"), False
    try:
        current = await session_of(services, pack, session.sid)
        run = run_label(websocket.headers.get(RUN_HEADER))
        return await handler(services, pack, current, data, run), False
    except EpisodeRefused as exc:
        return _error_frame(exc.message, exc.code), False
    except Exception as exc:  # an outage (Redis, the database) is a 503's message; a bug is logged
        failure = answer_to(exc, services.settings.retry_after_seconds)
        if failure is None:
            log.exception("OpenEnv frame %r failed", kind)
            return _error_frame(f"internal error: {type(exc).__name__}", "EXECUTION_ERROR"), False
        return _error_frame(failure.message, "EXECUTION_ERROR"), False


async def _on_reset(
    services: AppState, pack: str, session: EpisodeSession, data: Any, run: str
) -> dict[str, Any]:
    started = await reset(services, pack, session, data, run)
    return _frame("observation", reset_observation(started))


async def _on_state(
    services: AppState, pack: str, session: EpisodeSession, data: Any, run: str
) -> dict[str, Any]:
    return _frame("state", state_of(session))


async def _on_step(
    services: AppState, pack: str, session: EpisodeSession, data: Any, run: str
) -> dict[str, Any]:
    action = data if isinstance(data, dict) else {}
    kind = action.get("type")
    metadata = {"trace_id": session.trace_id} if session.trace_id else {}
    if kind == "list_tools":
        tools = episode.tool_specs(services.registry, pack, user=services.user is not None)
        return _observed({"tools": tools}, metadata=metadata)
    if kind != "call_tool" or not isinstance(action.get("tool_name"), str):
        raise EpisodeRefused(
            'a step is {"type": "list_tools"} or {"type": "call_tool", "tool_name", "arguments"}',
            code="VALIDATION_ERROR",
        )
    name = action["tool_name"]
    call_id = given_call_id(action.get("metadata"), "call_id")
    answer = await act(services, session, name, action.get("arguments") or {}, call_id)
    observation = answer.observation(name)
    return _observed(observation, reward=answer.reward, done=answer.done, metadata=answer.metadata)


Handler = Callable[[AppState, str, EpisodeSession, Any, str], Awaitable[dict[str, Any]]]
_HANDLERS: dict[str, Handler] = {"reset": _on_reset, "state": _on_state, "step": _on_step}


# --- OpenEnv's JSON-RPC (`POST mcp`) ----------------------------------------------------------------

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
SERVER_ERROR, INTERNAL_ERROR = -32000, -32603


class RpcError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _rpc(request_id: Any, *, result: Any = None, error: RpcError | None = None) -> Response:
    if error is not None:
        body = {"jsonrpc": "2.0", "id": request_id, "error": {"code": error.code, "message": error.message}}
    else:
        body = {"jsonrpc": "2.0", "id": request_id, "result": result}
    return json_response(body)


async def answer_rpc(services: AppState, pack: str, request: Request) -> Response:
    """One JSON-RPC request; errors are JSON-RPC error objects with HTTP 200 (an outage is a 503)."""
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        return _rpc(None, error=RpcError(PARSE_ERROR, "Parse error"))
    if not isinstance(body, dict) or not isinstance(body.get("method"), str):
        return _rpc(None, error=RpcError(INVALID_REQUEST, "Invalid Request"))
    request_id, params = body.get("id"), body.get("params") or {}
    method = _METHODS.get(body["method"])
    try:
        if method is None:
            raise RpcError(METHOD_NOT_FOUND, f"Method not found: {body['method']}")
        if not isinstance(params, dict):
            raise RpcError(INVALID_PARAMS, "params must be an object")
        result = await method(services, pack, params, run_label(request.headers.get(RUN_HEADER)))
    except RpcError as exc:
        return _rpc(request_id, error=exc)
    except EpisodeRefused as exc:
        return _rpc(request_id, error=RpcError(SERVER_ERROR, exc.message))
    return _rpc(request_id, result=result)


async def _session_create(services: AppState, pack: str, params: dict[str, Any], run: str) -> Any:
    return {"session_id": (await open_session(services, run)).sid}


async def _tools_list(services: AppState, pack: str, params: dict[str, Any], run: str) -> Any:
    return {"tools": episode.tool_specs(services.registry, pack, user=services.user is not None)}


async def _tools_call(services: AppState, pack: str, params: dict[str, Any], run: str) -> Any:
    name, arguments = params.get("name"), params.get("arguments") or {}
    if not isinstance(name, str):
        raise RpcError(INVALID_PARAMS, "tools/call needs a tool name")
    sid = params.get("session_id")
    if sid is not None and not isinstance(sid, str):
        raise RpcError(INVALID_PARAMS, "session_id must be a string")
    try:
        call_id = given_call_id(params.get("_meta"), CALL_ID_META)
    except EpisodeRefused as exc:
        raise RpcError(INVALID_PARAMS, exc.message) from exc
    session = await session_of(services, pack, sid)
    answer = await act(services, session, name, arguments, call_id)
    if answer.error is not None:
        if answer.error["error_type"] == "transport_error":
            raise ServiceUnavailable(answer.error["message"], services.settings.retry_after_seconds)
        raise RpcError(INTERNAL_ERROR, answer.error["message"])
    return answer.result


async def _session_close(services: AppState, pack: str, params: dict[str, Any], run: str) -> Any:
    sid = params.get("session_id")
    if not isinstance(sid, str):
        raise RpcError(INVALID_PARAMS, "openenv/session/close needs a session_id")
    try:
        await session_of(services, pack, sid)  # only this mount's own sessions
    except EpisodeRefused:
        pass  # closed already (the socket's `close` ends it too): closing is idempotent
    else:
        await episode.session_store(services).close(sid)
    return {"session_id": sid, "closed": True}


Method = Callable[[AppState, str, dict[str, Any], str], Awaitable[Any]]
_METHODS: dict[str, Method] = {
    "openenv/session/create": _session_create,
    "tools/list": _tools_list,
    "tools/call": _tools_call,
    "openenv/session/close": _session_close,
}
