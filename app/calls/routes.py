"""Tool routes: HTTP only; the call service holds the logic."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel
from starlette.routing import Route

from app.auth import KeyRing
from app.calls.envelope import ToolCallEnvelope, ToolCallOutput
from app.calls.service import ToolCallService
from app.deps import RegistryDep, ToolsKey
from app.errors import BadRequest, json_response

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
# served by the plain Starlette routes of `tool_call_routes`, which create_app puts first: the same
# `_call`, without FastAPI's per-request dependency resolution, which on this path cost more than
# the call's own Redis round trips.


@router.post("/tools", response_model=ToolCallOutput)
async def call_tool_by_body(request: Request, _: ToolsKey) -> Response:
    return await _call(request, None)


@router.post("/tools/{name}", response_model=ToolCallOutput)
async def call_tool(name: str, request: Request, _: ToolsKey) -> Response:
    return await _call(request, name)


async def _call_by_body(request: Request) -> Response:
    return await _call(request, None)


async def _call_by_path(request: Request) -> Response:
    return await _call(request, request.path_params["name"])


def tool_call_routes() -> list[Route]:
    return [
        Route("/tools/{name}", _call_by_path, methods=["POST"], include_in_schema=False),
        Route("/tools", _call_by_body, methods=["POST"], include_in_schema=False),
    ]
