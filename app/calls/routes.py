"""Tool routes: HTTP only; the call service holds the logic."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import ASGIApp, Receive, Scope, Send

from app.auth import KeyRing
from app.calls.envelope import ToolCallEnvelope, ToolCallOutput
from app.calls.service import ToolCallService
from app.deps import RegistryDep, ToolsKey
from app.errors import BadRequest, SparringError, handle_outage, handle_sparring_error, json_response

router = APIRouter(tags=["tools"])

RUN_HEADER = "X-Sparring-Run"


class ToolInfo(BaseModel):
    name: str
    pack: str
    description: str
    mutates: bool
    parameters: dict[str, Any]


async def _envelope(request: Request) -> ToolCallEnvelope:
    body = await request.body()
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
    envelope = await _envelope(request)
    output = await service.handle(envelope, path_name=path_name, run=request.headers.get(RUN_HEADER))
    return json_response(output.model_dump())


# The two routes below define the tool-call API and its OpenAPI description. Requests to them are
# served by `ToolCallFastPath`, a middleware create_app installs inside the body limit: the same
# `_call`, without the routing, exception and dependency layers of the app, which on this path cost
# more than the call's own Redis work.


@router.post("/tools", response_model=ToolCallOutput)
async def call_tool_by_body(request: Request, _: ToolsKey) -> Response:
    return await _call(request, None)


@router.post("/tools/{name}", response_model=ToolCallOutput)
async def call_tool(name: str, request: Request, _: ToolsKey) -> Response:
    return await _call(request, name)


_NOT_A_TOOL_CALL = "/"  # no tool name contains a slash


def _tool_call_target(scope: Scope) -> str | None:
    """The tool named by a `POST /tools/{name}` path, None for `POST /tools`, else _NOT_A_TOOL_CALL."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return _NOT_A_TOOL_CALL
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        path = path[len(root) :]
    if path == "/tools":
        return None
    name = path[len("/tools/") :] if path.startswith("/tools/") else ""
    return name if name and "/" not in name else _NOT_A_TOOL_CALL


class ToolCallFastPath:
    """Serves the two tool-call routes directly, errors rendered by the app's own handlers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = _tool_call_target(scope)
        if target == _NOT_A_TOOL_CALL:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await _call(request, target)
        except SparringError as exc:
            response = await handle_sparring_error(request, exc)
        except (SQLAlchemyError, RedisError, OSError) as exc:
            response = await handle_outage(request, exc)
        await response(scope, receive, send)
