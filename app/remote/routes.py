"""`POST <prefix>/init` and `GET <prefix>/status`: HTTP only, the service holds the logic."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from app.config import Settings
from app.deps import RemoteDep, require
from app.remote.schemas import InitRequest, InitResponse, StatusResponse, check_rollout_id, parse_init

# Declared, not read by FastAPI: `parse_init` reads the body itself (orjson, with sparring's limits).
_INIT_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": InitRequest.model_json_schema()}},
    }
}


def remote_router(settings: Settings) -> APIRouter:
    """The remote rollout routes under SPARRING_REMOTE_PREFIX; keyless only behind a secret prefix."""
    guard: list[Any] = [] if settings.remote_open else [Depends(require("tools"))]
    router = APIRouter(prefix=settings.remote_prefix, tags=["remote rollouts"], dependencies=guard)

    @router.post("/init", response_model=InitResponse, openapi_extra=_INIT_BODY)
    async def init(request: Request, service: RemoteDep) -> InitResponse:
        """Start a rollout in the background (eval-protocol's remote rollout processor calls this)."""
        return InitResponse.model_validate(await service.init(parse_init(await request.body())))

    @router.get("/status", response_model=StatusResponse)
    async def status(rollout_id: Annotated[str, Query(max_length=200)], service: RemoteDep) -> StatusResponse:
        """`terminated`, the AIP-193 `status`, and the rollout's trace id, state, reason and reward."""
        return StatusResponse.model_validate(await service.status(check_rollout_id(rollout_id)))

    return router
