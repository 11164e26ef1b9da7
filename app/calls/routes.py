"""Tool routes: HTTP only; the call service holds the logic."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import Receive, Scope, Send

from app.auth import KeyRing
from app.calls.envelope import ToolCallEnvelope, ToolCallOutput
from app.calls.service import ToolCallService
from app.deps import RegistryDep, ToolsKey
from app.errors import BadRequest, SparringError, handle_outage, handle_sparring_error, json_response
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
    return ToolCallEnvelope.model_validate(data)


@router.get("/tools")
async def list_tools(_: ToolsKey, registry: RegistryDep) -> list[ToolInfo]:
    return [
        ToolInfo(
            name=spec.name,
            pack=spec.pack,
            description=spec.description,
            mutates=spec.mutates,
            parameters=spec.parameters,
        )
        for spec in registry.tools.values()
    ]


async def _call(request: Request, path_name: str | None) -> Response:
    keyring: KeyRing = request.app.state.keyring
    keyring.authorize(request, "tools")
    service: ToolCallService = request.app.state.call_service
    envelope = _parse_envelope(await request.body())
    output = await service.handle(envelope, path_name=path_name, run=request.headers.get(RUN_HEADER))
    return json_response(output.model_dump())


# The two routes below define the tool-call API and its OpenAPI description. Requests to them are
# answered by `serve_tool_call`, which `SparringApp` (app.main) calls before the app's middleware
# stack: the same `_call`, without the routing, exception, telemetry and dependency layers of the
# app, which on this path cost more than the call's own Redis work.


@router.post("/tools", response_model=ToolCallOutput)
async def call_tool_by_body(request: Request, _: ToolsKey) -> Response:
    return await _call(request, None)


@router.post("/tools/{name}", response_model=ToolCallOutput)
async def call_tool(name: str, request: Request, _: ToolsKey) -> Response:
    return await _call(request, name)


NOT_A_TOOL_CALL = "/"  # no tool name contains a slash
TOOL_SCOPE_KEY = "sparring.tool"  # where SparringApp leaves the target for serve_tool_call


def tool_call_target(scope: Scope) -> str | None:
    """The tool named by a `POST /tools/{name}` path, None for `POST /tools`, else NOT_A_TOOL_CALL."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return NOT_A_TOOL_CALL
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        path = path[len(root) :]
    if path == "/tools":
        return None
    name = path[len("/tools/") :] if path.startswith("/tools/") else ""
    return name if name and "/" not in name else NOT_A_TOOL_CALL


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
        request.app.state.keyring.authorize(request, "tools")
        envelope = _parse_envelope(await _read_body(receive))
        service: ToolCallService = request.app.state.call_service
        output = await service.handle(
            envelope, path_name=scope[TOOL_SCOPE_KEY], run=request.headers.get(RUN_HEADER)
        )
    except _Disconnected:
        return  # the client went away before sending its call: nothing ran, nobody to answer
    except SparringError as exc:
        await (await handle_sparring_error(request, exc))(scope, receive, send)
        return
    except (SQLAlchemyError, RedisError, OSError) as exc:
        await (await handle_outage(request, exc))(scope, receive, send)
        return
    except BodyTooLarge:
        raise  # the body limit around this answers 413
    except Exception:
        # A bug in sparring, not in a tool (tools' exceptions are ToolCrashed): the app's own 500.
        log.exception("unexpected error answering a tool call")
        error = {
            "error": {"code": "internal_error", "message": "unexpected server error; see the server log"}
        }
        await json_response(error, status_code=500)(scope, receive, send)
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
