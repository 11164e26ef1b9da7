"""Tool routes: HTTP only; `ToolCallService.handle` (app/calls/service.py) holds the logic.

A tool call has one implementation, `serve_tool_call`: `SparringApp` (app.main) calls it ahead of the
app's middleware stack. The FastAPI routes below declare the same paths for the OpenAPI document;
should a request ever reach them, they answer through `serve_tool_call` too.

`/tools` and `/tools/{name}` serve the names one enabled pack has; `/packs/{pack}/tools` and
`/packs/{pack}/tools/{name}` serve every tool of a pack, also a name several packs share.
`/user-tools/{name}` and `/packs/{pack}/user-tools/{name}` serve a simulated user's tools (telecom's
phone) the same way: the same envelope, key and exactly-once rule, logged on the channel `user`.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from app.calls.envelope import ToolCallEnvelope, ToolCallOutput
from app.calls.service import USER_CHANNEL
from app.deps import RegistryDep, ToolsKey, app_state, retry_after
from app.errors import INTERNAL_ERROR, BadRequest, NotFound, answer_to, handle_sparring_error, json_response
from app.middleware import BodyTooLarge
from app.rollouts.identity import RUN_HEADER

log = logging.getLogger(__name__)

router = APIRouter(tags=["tools"])


class ToolInfo(BaseModel):
    name: str
    pack: str
    description: str
    mutates: bool
    parameters: dict[str, Any]


def _parse_envelope(body: bytes) -> ToolCallEnvelope:
    try:
        data = orjson.loads(body) if body else {}
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object (a function_call item)")
    try:
        return ToolCallEnvelope.model_validate(data)
    except ValidationError as exc:
        fields = ", ".join(str(error["loc"][0]) for error in exc.errors() if error["loc"])
        raise BadRequest(f"the call's {fields or 'fields'} cannot be read: {exc.errors()[0]['msg']}") from exc


@router.get("/tools")
async def list_tools(_: ToolsKey, registry: RegistryDep, pack: str | None = None) -> list[ToolInfo]:
    """The tools served at /tools/<name>; with `?pack=`, every tool of that pack (its qualified routes)."""
    tools = registry.tools if pack is None else _pack_tools(registry, pack)
    return [
        ToolInfo(
            name=spec.name,
            pack=spec.pack,
            description=spec.description,
            mutates=spec.mutates,
            parameters=spec.parameters,
        )
        for spec in tools.values()
    ]


@router.get("/user-tools")
async def list_user_tools(_: ToolsKey, registry: RegistryDep, pack: str | None = None) -> list[ToolInfo]:
    """The simulated user's tools (never offered to the agent); with `?pack=`, that pack's."""
    if pack is not None:
        _pack_tools(registry, pack)
    tools = registry.all_user_tools() if pack is None else registry.user_tools.get(pack, {})
    return [
        ToolInfo(
            name=spec.name,
            pack=spec.pack,
            description=spec.description,
            mutates=spec.mutates,
            parameters=spec.parameters,
        )
        for spec in tools.values()
    ]


def _pack_tools(registry: Any, pack: str) -> dict[str, Any]:
    tools: dict[str, Any] | None = registry.pack_tools.get(pack)
    if tools is None:
        enabled = ", ".join(registry.pack_tools) or "none"
        raise NotFound(f"no enabled pack named {pack!r} (enabled: {enabled})")
    return tools


TOOLS_PATH = "/tools"  # POST: the tool named by the body's `name`
TOOL_PATH = "/tools/{name}"  # POST: the tool `name`
PACK_TOOLS_PATH = "/packs/{pack}/tools"  # POST: the tool of `pack` named by the body's `name`
PACK_TOOL_PATH = "/packs/{pack}/tools/{name}"  # POST: the tool `name` of `pack`
USER_TOOL_PATH = "/user-tools/{name}"  # POST: the simulated user's tool `name`
PACK_USER_TOOL_PATH = "/packs/{pack}/user-tools/{name}"  # POST: the user tool `name` of `pack`


class _ServedByToolCall(Response):
    """Answers through `serve_tool_call`: the routes below have no tool-call code of their own."""

    def __init__(self, target: str | None) -> None:
        super().__init__()
        self.target = target

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[TOOL_SCOPE_KEY] = self.target
        await serve_tool_call(scope, receive, send)


# Declared, not read by FastAPI: serve_tool_call reads the body itself (tolerantly: any JSON object).
_CALL_BODY: dict[str, Any] = {
    "requestBody": {
        "description": "A Responses `function_call` item with `trace_id` and `item`; every field optional.",
        "content": {"application/json": {"schema": ToolCallEnvelope.model_json_schema()}},
    }
}
_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "The body is not a JSON object."},
    401: {"description": "No key, or an unknown key."},
    403: {"description": "A key without the `tools` scope."},
    413: {"description": "The body is over SPARRING_MAX_BODY_BYTES."},
    500: {"description": "A tool crashed: the rollout must not be trained on."},
    503: {"description": "Redis or the database is unreachable, or the tool missed its deadline."},
}


@router.post(TOOLS_PATH, response_model=ToolCallOutput, responses=_RESPONSES, openapi_extra=_CALL_BODY)
async def call_tool_by_body() -> Response:
    """Call the tool the body's `name` names; model mistakes are `Error: ...` outputs with 200."""
    return _ServedByToolCall(None)


@router.post(TOOL_PATH, response_model=ToolCallOutput, responses=_RESPONSES, openapi_extra=_CALL_BODY)
async def call_tool(name: str) -> Response:
    """Call the tool `name`; model mistakes are `Error: ...` outputs with 200."""
    return _ServedByToolCall(name)


_PACK_RESPONSES = {**_RESPONSES, 404: {"description": "No enabled pack has this name."}}
_PACK_ROUTE: dict[str, Any] = {
    "response_model": ToolCallOutput,
    "responses": _PACK_RESPONSES,
    "openapi_extra": _CALL_BODY,
}


@router.post(PACK_TOOLS_PATH, **_PACK_ROUTE)
async def call_pack_tool_by_body(pack: str) -> Response:
    """Call the tool of `pack` the body's `name` names (also a name several packs share)."""
    return _ServedByToolCall(None)


@router.post(PACK_TOOL_PATH, **_PACK_ROUTE)
async def call_pack_tool(pack: str, name: str) -> Response:
    """Call the tool `name` of `pack` (also a name several packs share)."""
    return _ServedByToolCall(name)


@router.post(USER_TOOL_PATH, **_PACK_ROUTE)
async def call_user_tool(name: str) -> Response:
    """Call the simulated user's tool `name` (a customer's phone); logged on the channel `user`."""
    return _ServedByToolCall(name)


@router.post(PACK_USER_TOOL_PATH, **_PACK_ROUTE)
async def call_pack_user_tool(pack: str, name: str) -> Response:
    """Call the simulated user's tool `name` of `pack`."""
    return _ServedByToolCall(name)


NOT_A_TOOL_CALL = "/"  # no tool name contains a slash
_TOOL_PREFIX = TOOL_PATH.removesuffix("{name}")
TOOL_SCOPE_KEY = "sparring.tool"  # where SparringApp leaves the target for serve_tool_call


def tool_call_target(scope: Scope) -> str | None:
    """The tool named by a `POST /tools/{name}` or `POST /packs/{pack}/tools/{name}` path, None for
    `POST /tools` or `POST /packs/{pack}/tools`, else NOT_A_TOOL_CALL."""
    parts = _tool_path(scope)
    return NOT_A_TOOL_CALL if parts is None else parts[1]


def tool_call_pack(scope: Scope) -> str | None:
    """The pack a tool call's path names (`/packs/{pack}/tools...`), None for `/tools...`."""
    parts = _tool_path(scope)
    return None if parts is None else parts[0]


def is_user_tool_call(scope: Scope) -> bool:
    """Whether a tool call's path is a simulated user's (`.../user-tools/{name}`)."""
    path: str = scope["path"]
    return _USER_TOOL_PREFIX in path


def _tool_path(scope: Scope) -> tuple[str | None, str | None] | None:
    """(pack, tool name) of a tool-call path, either None where the path does not name it; None for
    any other request."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        path = path[len(root) :]
    # A server URL registered with a trailing slash names the same tool: answered here, not with a
    # redirect, which a training service need not follow (and would show the model as an error).
    path = path[:-1] if path.endswith("/") and len(path) > 1 else path
    pack = None
    if path.startswith(_PACKS_PREFIX):
        pack, _, path = path[len(_PACKS_PREFIX) :].partition("/")
        if not pack:
            return None
        path = "/" + path
    if path == TOOLS_PATH:
        return pack, None
    prefix = _USER_TOOL_PREFIX if path.startswith(_USER_TOOL_PREFIX) else _TOOL_PREFIX
    name = path[len(prefix) :] if path.startswith(prefix) else ""
    return (pack, name) if name and "/" not in name else None


_PACKS_PREFIX = "/packs/"
_USER_TOOL_PREFIX = USER_TOOL_PATH.removesuffix("{name}")


class _Disconnected(Exception):
    pass


async def _read_body(receive: Receive) -> bytes:
    """The whole request body, straight from the server (the body limit wraps `receive`)."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _Disconnected
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


_JSON_HEADERS = (b"content-type", b"application/json")


async def serve_tool_call(scope: Scope, receive: Receive, send: Send) -> None:
    """Answer one tool call as plain ASGI; errors are rendered by the app's own handlers."""
    request = Request(scope, receive)
    try:
        state = app_state(request.app)
        state.keyring.authorize(request, "tools")
        pack = tool_call_pack(scope)
        if pack is not None:
            _pack_tools(state.registry, pack)  # 404 for a pack that is not enabled
        envelope = _parse_envelope(await _read_body(receive))
        user = is_user_tool_call(scope)
        answered = await state.call_service.call(
            envelope,
            path_name=scope[TOOL_SCOPE_KEY],
            pack=pack,
            run=request.headers.get(RUN_HEADER),
            channel=USER_CHANNEL if user else "rft",
            user=user,
        )
        output = answered.output
    except _Disconnected:
        return  # the client went away before sending its call: nothing ran, nobody to answer
    except BodyTooLarge:
        raise  # the body limit around this answers 413
    except Exception as exc:
        error = answer_to(exc, retry_after(request.app))
        if error is None:
            # A bug in sparring, not in a tool (tools' exceptions are ToolCrashed): the app's own 500.
            log.exception("unexpected error answering a tool call")
            await json_response(INTERNAL_ERROR, status_code=500)(scope, receive, send)
            return
        await (await handle_sparring_error(request, error))(scope, receive, send)
        return
    payload = orjson.dumps(output.model_dump())
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [_JSON_HEADERS, (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})
