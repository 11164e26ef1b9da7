"""Code pack fixtures: HumanEval (fetched once per machine), the real bwrap sandbox, and HTTP helpers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.deps import app_state
from tests.conftest import ADMIN_KEY, AppFactory, new_trace
from tools.code import data, pack
from tools.code.runtime import CodeSettings, build_sandbox
from tools.code.sandbox import Sandbox
from tools.code.tasks import CodeTask, load_tasks

REPO_ROOT = Path(__file__).resolve().parents[2]
HOME = REPO_ROOT / ".sparring"  # the cache `make run` uses too: the download happens once


DATA_DIR = data.DATA.cache_dir(HOME)


@pytest.fixture(scope="session", autouse=True)
def code_data() -> Path:
    return data.DATA.fetch(DATA_DIR)


def all_tasks() -> Mapping[str, CodeTask]:
    """The HumanEval tasks of the cache (fetched by the session's `code_data`)."""
    return load_tasks(DATA_DIR)


@pytest.fixture
def code_sandbox(tmp_path: Path) -> Iterator[Sandbox]:
    """The real bwrap sandbox, outside a server (a server's code pack builds and owns its own)."""
    built = build_sandbox(CodeSettings(), home=tmp_path, binds_loopback=True)
    yield built
    built.close()


def served_resources(client: httpx.AsyncClient) -> dict[str, object]:
    """The resources of the packs the app `client` talks to, by pack name (the code pack's: "code")."""
    return app_state(client.app).registry.resources  # type: ignore[attr-defined]


class CodeClient:
    """Tool calls and grades of the code pack over HTTP."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.http = client
        self._calls = 0

    async def call(
        self,
        trace: str,
        name: str,
        arguments: dict[str, Any],
        *,
        task_id: str | None,
        call_id: str | None = None,
    ) -> str:
        self._calls += 1
        body = {
            "type": "function_call",
            "call_id": call_id or f"call_{self._calls}",
            "name": name,
            "arguments": json.dumps(arguments),
            "trace_id": trace,
            "item": {"task_id": task_id} if task_id else {},
        }
        response = await self.http.post(f"/tools/{name}", json=body)
        assert response.status_code == 200, response.text
        return str(response.json()["output"])

    async def run(
        self, trace: str, path: str, *, task_id: str | None = None, args: list[str] | None = None
    ) -> Any:
        output = await self.call(trace, "run_python", {"path": path, "args": args}, task_id=task_id)
        assert not output.startswith("Error:"), output
        return json.loads(output)

    async def write(self, trace: str, path: str, content: str, *, task_id: str | None = None) -> str:
        return await self.call(trace, "write_file", {"path": path, "content": content}, task_id=task_id)

    async def grade(self, trace: str, task_id: str) -> float:
        response = await self.http.post(
            "/grade/code",
            json={"sample": {"output_text": "done"}, "item": {"task_id": task_id}, "trace_id": trace},
        )
        assert response.status_code == 200, response.text
        return float(response.json()["score"])

    async def flags(self, trace: str) -> dict[str, str]:
        timeline = (await self.http.get(f"/review/api/rollouts/{trace}")).json()
        return {flag["name"]: flag["reason"] for flag in timeline["grades"][-1]["flags"]}

    async def solve(self, task_id: str, solution: str) -> tuple[str, float]:
        """A rollout that writes `solution` as solution.py, then its grade."""
        trace = new_trace()
        written = await self.write(trace, "solution.py", solution, task_id=task_id)
        assert written.startswith("wrote "), written
        return trace, await self.grade(trace, task_id)


@pytest.fixture
def sandbox_path() -> str:
    """Which path the code pack's runs take: "warm" (the default, forks of a warm parent) or "cold" (a
    bwrap per run). Modules parametrize it (`pytest.mark.parametrize("sandbox_path", [...])`) to run their
    tests on both."""
    return "warm"


@pytest.fixture
def code_app(app_factory: AppFactory, code_data: Path, sandbox_path: str) -> Any:
    @asynccontextmanager
    async def start(code: dict[str, Any] | None = None, **overrides: Any) -> AsyncIterator[CodeClient]:
        """An app serving the code pack; `code` holds code-pack settings (SPARRING_CODE_*) to set."""
        path = {"warm": False} if sandbox_path == "cold" else {}
        settings = {"data": code_data, **path, **(code or {})}
        async with app_factory(
            packs=[pack], key=ADMIN_KEY, pack_settings={"code": settings}, **overrides
        ) as client:
            yield CodeClient(client)

    return start


async def gather_bounded(limit: int, *coroutines: Any) -> list[Any]:
    """Run coroutines concurrently, at most `limit` at a time (the machine has few cores)."""
    semaphore = asyncio.Semaphore(limit)

    async def bounded(coroutine: Any) -> Any:
        async with semaphore:
            return await coroutine

    return await asyncio.gather(*(bounded(c) for c in coroutines))
