"""The shared Task API of the episode protocols: a pack's tasks are its `sparring dataset build` lines.

One handler serves both mounts (ORS at the origin root, OpenEnv under `/openenv/<pack>`); the rows are
what the pack's own dataset builder writes, in file order, so a task an episode starts from is the
same line a training job would read.
"""

from __future__ import annotations

import tempfile
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio.to_thread
import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from app.deps import app_state
from app.errors import SparringError, json_response
from app.packs import Registry
from app.sdk import Pack

SPLITS = ("train", "test")


class TaskApiError(SparringError):
    """A Task API refusal, in the body the protocols' clients read: `{"detail": message}`."""

    def body(self) -> dict[str, Any]:
        return {"detail": self.message}


class UnknownEnv(TaskApiError):
    status_code = 404
    code = "unknown_env"


class InvalidSplit(TaskApiError):
    status_code = 400
    code = "invalid_split"

    def __init__(self) -> None:
        super().__init__("Invalid split")


class InvalidIndex(TaskApiError):
    status_code = 400
    code = "invalid_index"

    def __init__(self) -> None:
        super().__init__("Invalid index")


# The lines of each started pack's splits, as its builder wrote them (bytes, parsed per request so no
# caller can change another's rows). Keyed by the started pack: two apps in one process never mix.
_LINES: weakref.WeakKeyDictionary[Pack, dict[str, tuple[bytes, ...]]] = weakref.WeakKeyDictionary()
_BUILDING = threading.Lock()


def started_pack(registry: Registry, pack: str) -> Pack:
    """The started pack named `pack` (UnknownEnv if it is not enabled)."""
    found = registry.packs.get(pack)
    if found is None:
        raise UnknownEnv(f"Environment {pack!r} not found")
    return found


def has_tasks(registry: Registry, pack: str) -> bool:
    return started_pack(registry, pack).dataset_builder is not None


def _lines(registry: Registry, pack: str, split: str) -> tuple[bytes, ...]:
    started = started_pack(registry, pack)
    builder = started.dataset_builder
    if builder is None or split not in SPLITS:
        raise InvalidSplit
    with _BUILDING:
        splits = _LINES.setdefault(started, {})
        lines = splits.get(split)
        if lines is None:
            with tempfile.TemporaryDirectory(prefix="sparring-tasks-") as directory:
                out = Path(directory) / f"{pack}-{split}.jsonl"
                try:
                    builder(started.resources, split, out)
                except ValueError as exc:
                    raise InvalidSplit from exc
                lines = splits[split] = tuple(line for line in out.read_bytes().splitlines() if line.strip())
    return lines


def task_rows(pack: str, split: str, *, registry: Registry) -> list[dict[str, Any]]:
    """Exactly the rows `sparring dataset build <pack> --split <split>` writes, in file order.

    Blocking the first time a split is read (the pack's builder runs): call it in a thread from async
    code (`load_task_rows`). Raises UnknownEnv (404) or InvalidSplit (400).
    """
    return [orjson.loads(line) for line in _lines(registry, pack, split)]


def task_row(pack: str, split: str, index: int, *, registry: Registry) -> dict[str, Any]:
    """Row `index` of a split (InvalidIndex past either end: no negative indexing)."""
    lines = _lines(registry, pack, split)
    if not 0 <= index < len(lines):
        raise InvalidIndex
    row: dict[str, Any] = orjson.loads(lines[index])
    return row


async def load_task_rows(registry: Registry, pack: str, split: str) -> list[dict[str, Any]]:
    return await anyio.to_thread.run_sync(lambda: task_rows(pack, split, registry=registry))


async def load_task_row(registry: Registry, pack: str, split: str, index: int) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(lambda: task_row(pack, split, index, registry=registry))


class SplitBody(BaseModel):
    split: str


class IndexBody(SplitBody):
    index: int


class RangeBody(SplitBody):
    start: int | None = None
    stop: int | None = None


def task_router(envs: Callable[[Request], list[str]]) -> APIRouter:
    """The Task API routes, mountable under any prefix; `envs(request)` lists the packs this mount serves.

    It checks no key itself: each front door includes it with its own key check as a dependency
    (`include_router(..., dependencies=[...])`), since the key travels in a different header for each.
    """
    router = APIRouter(tags=["Task API"])

    def served(request: Request, env: str) -> Registry:
        registry = app_state(request.app).registry
        if env not in envs(request):
            raise UnknownEnv(f"Environment {env!r} not found")
        started_pack(registry, env)
        return registry

    @router.get("/list_environments")
    async def list_environments(request: Request) -> list[str]:
        return envs(request)

    @router.get("/{env}/splits")
    async def splits(env: str, request: Request) -> list[dict[str, str]]:
        registry = served(request, env)
        return [{"name": s, "type": s} for s in SPLITS] if has_tasks(registry, env) else []

    @router.post("/{env}/tasks")
    async def tasks(env: str, body: SplitBody, request: Request) -> Response:
        rows = await load_task_rows(served(request, env), env, body.split)
        return json_response({"tasks": rows, "env_name": env})

    @router.post("/{env}/num_tasks")
    async def num_tasks(env: str, body: SplitBody, request: Request) -> dict[str, int]:
        registry = served(request, env)
        lines = await anyio.to_thread.run_sync(lambda: _lines(registry, env, body.split))
        return {"num_tasks": len(lines)}

    @router.post("/{env}/task")
    async def task(env: str, body: IndexBody, request: Request) -> Response:
        row = await load_task_row(served(request, env), env, body.split, body.index)
        return json_response({"task": row, "env_name": env})

    @router.post("/{env}/task_range")
    async def task_range(env: str, body: RangeBody, request: Request) -> Response:
        rows = await load_task_rows(served(request, env), env, body.split)
        return json_response({"tasks": rows[body.start : body.stop], "env_name": env})

    return router
