"""Grader routes: POST /grade (the default grader) and POST /grade/{name}; HTTP only."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from app.deps import GraderKey, GradingDep
from app.errors import BadRequest, json_response
from app.grading.service import GradingService
from app.rollouts.identity import JSON_DEPTH_MAX, RUN_HEADER, RUN_MAX, fit, nested_deeper_than, trace_key

router = APIRouter(tags=["graders"])


class GradeAnswer(BaseModel):
    score: float


class GraderInfo(BaseModel):
    name: str
    version: str
    default: bool
    needs_rollout: bool


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


async def _grade(request: Request, service: GradingService, name: str | None) -> Response:
    body = await request.body()
    try:
        data = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest('request body must be a JSON object: {"sample": ..., "item": ..., "trace_id": ...}')
    for part in ("sample", "item"):
        if nested_deeper_than(data.get(part)):
            raise BadRequest(f"the {part} nests more than {JSON_DEPTH_MAX} levels deep")
    trace_id = data.get("trace_id")
    if nested_deeper_than(trace_id):  # tolerated as its text, but `str()` of it would recurse too deep
        raise BadRequest(f"the trace_id nests more than {JSON_DEPTH_MAX} levels deep; it is text")
    trace_id = trace_key(str(trace_id)) if trace_id not in (None, "") else None
    run = request.headers.get(RUN_HEADER)
    result = await service.grade(
        name,
        _mapping(data.get("sample")),
        _mapping(data.get("item")),
        trace_id,
        run=fit(run, RUN_MAX) if run else None,
    )
    return json_response({"score": result.score})


@router.get("/grade")
async def list_graders(_: GraderKey, service: GradingDep) -> list[GraderInfo]:
    return [
        GraderInfo(
            name=g.name, version=g.version, default=g.name == service.default, needs_rollout=g.needs_rollout
        )
        for g in sorted(service.graders.values(), key=lambda g: g.name)
    ]


@router.post("/grade", response_model=GradeAnswer)
async def grade_default(request: Request, _: GraderKey, service: GradingDep) -> Response:
    """Score a rollout with the default grader (SPARRING_DEFAULT_GRADER, or the only one)."""
    return await _grade(request, service, None)


@router.post("/grade/{name}", response_model=GradeAnswer)
async def grade_named(name: str, request: Request, _: GraderKey, service: GradingDep) -> Response:
    """Score a rollout with the grader `name`: answers exactly {"score": <float>}."""
    return await _grade(request, service, name)
