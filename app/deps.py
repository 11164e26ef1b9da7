"""Small dependencies that reach what the lifespan built (resources live on app.state).

They are `async def` on purpose: FastAPI runs a plain `def` dependency in its thread pool, a thread
hand-off per dependency per request that costs more than the tool call itself.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.auth import require
from app.calls.service import ToolCallService
from app.config import Scope, Settings
from app.packs import Registry
from app.rollouts.store import RolloutStore


async def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_registry(request: Request) -> Registry:
    registry: Registry = request.app.state.registry
    return registry


async def get_store(request: Request) -> RolloutStore:
    store: RolloutStore = request.app.state.store
    return store


async def get_call_service(request: Request) -> ToolCallService:
    service: ToolCallService = request.app.state.call_service
    return service


async def get_sessionmaker(request: Request) -> async_sessionmaker[AsyncSession]:
    maker: async_sessionmaker[AsyncSession] = request.app.state.sessionmaker
    return maker


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
RegistryDep = Annotated[Registry, Depends(get_registry)]
StoreDep = Annotated[RolloutStore, Depends(get_store)]
CallServiceDep = Annotated[ToolCallService, Depends(get_call_service)]
SessionMakerDep = Annotated[async_sessionmaker[AsyncSession], Depends(get_sessionmaker)]
ToolsKey = Annotated[Scope, Depends(require("tools"))]
GraderKey = Annotated[Scope, Depends(require("grader"))]
AdminKey = Annotated[Scope, Depends(require("admin"))]
