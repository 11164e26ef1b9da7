"""Tool routes: HTTP only; the call service holds the logic."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from app.calls.envelope import ToolCallEnvelope, ToolCallOutput
from app.deps import CallServiceDep, RegistryDep, ToolsKey
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


@router.post("/tools", response_model=ToolCallOutput)
async def call_tool_by_body(request: Request, _: ToolsKey, service: CallServiceDep) -> Response:
    envelope = await _envelope(request)
    output = await service.handle(envelope, path_name=None, run=request.headers.get(RUN_HEADER))
    return json_response(output.model_dump())


@router.post("/tools/{name}", response_model=ToolCallOutput)
async def call_tool(name: str, request: Request, _: ToolsKey, service: CallServiceDep) -> Response:
    envelope = await _envelope(request)
    output = await service.handle(envelope, path_name=name, run=request.headers.get(RUN_HEADER))
    return json_response(output.model_dump())
