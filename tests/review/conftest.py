"""Review fixtures: an app with the review mounted (both backends), and grading the way the service does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.models import Grade, ToolCall
from app.deps import app_state
from app.grading.flags import DEFAULT_POLICY, FlagPolicy
from app.grading.recording import store_grade
from app.main import create_app
from app.rollouts.timeline import read_timeline
from tests.conftest import ADMIN_KEY, TOOLS_KEY, call_body, make_settings
from tests.packs import counter_pack, faults_pack
from tools.demo import pack as demo_pack

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TOOLS = {"Authorization": f"Bearer {TOOLS_KEY}"}
PACKS = [demo_pack, counter_pack, faults_pack]


async def grade_rollout(
    sessions: async_sessionmaker[AsyncSession],
    trace_id: str | None,
    *,
    answer: str,
    score: float | None,
    status: str = "ok",
    item: dict[str, Any] | None = None,
    run: str | None = None,
    grader: str = "test",
    errors: Sequence[str] = (),
    sub_scores: dict[str, float] | None = None,
    grader_flags: Sequence[dict[str, Any]] = (),
    policy: FlagPolicy = DEFAULT_POLICY,
) -> Grade:
    """Store a grade with its review flags, as the grading service does at grade time."""
    async with sessions() as session, session.begin():
        timeline = await read_timeline(session, trace_id) if trace_id else None
        grade, _ = await store_grade(
            session,
            trace_id=trace_id,
            calls=timeline.timeline if timeline is not None else ([] if trace_id else None),
            grader=grader,
            grader_version="1",
            status=status,
            score=score,
            sub_scores=sub_scores or ({} if score is None else {"total": score}),
            grader_flags=grader_flags,
            errors=errors,
            sample={"output_text": answer},
            item=item or {},
            run=run,
            latency_ms=1.0,
            created_at=datetime.now(UTC),
            policy=policy,
        )
    return grade


@dataclass
class ReviewApp:
    app: FastAPI
    client: httpx.AsyncClient  # sends no key unless told

    @property
    def sessions(self) -> async_sessionmaker[AsyncSession]:
        maker: async_sessionmaker[AsyncSession] = app_state(self.app).sessionmaker
        return maker

    async def call(
        self,
        tool: str,
        arguments: Any,
        trace_id: str,
        *,
        call_id: str | None = None,
        run: str | None = None,
        item: dict[str, Any] | None = None,
    ) -> httpx.Response:
        headers = dict(TOOLS)
        if run is not None:
            headers["X-Sparring-Run"] = run
        extra: dict[str, Any] = {"item": item} if item is not None else {}
        body = call_body(arguments, trace_id=trace_id, call_id=call_id, **extra)
        return await self.client.post(f"/tools/{tool}", json=body, headers=headers)

    async def api(self, path: str, **params: Any) -> Any:
        response = await self.client.get(
            path, params={k: v for k, v in params.items() if v is not None}, headers=ADMIN
        )
        assert response.status_code == 200, response.text
        return response.json()

    async def grade(self, trace_id: str | None, **kwargs: Any) -> Grade:
        return await grade_rollout(self.sessions, trace_id, **kwargs)

    async def wait_for_calls(self, trace_id: str, count: int) -> None:
        """Calls answered 503 are logged without waiting: poll until they are in."""
        for _ in range(100):
            async with self.sessions() as session:
                found = (
                    await session.scalars(select(ToolCall.id).where(ToolCall.trace_id == trace_id))
                ).all()
            if len(found) >= count:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{trace_id}: {len(found)} calls logged, expected {count}")


@pytest.fixture
def review_factory(tmp_path: Path, backend_settings: dict[str, Any]) -> Any:
    @asynccontextmanager
    async def factory(packs: Sequence[Any] = PACKS, **overrides: Any) -> AsyncIterator[ReviewApp]:
        settings = make_settings(tmp_path / "home", **{**backend_settings, **overrides})
        app = create_app(settings, packs=list(packs))
        async with LifespanManager(app) as manager:
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://sparring") as client:
                yield ReviewApp(app=app, client=client)

    return factory


@pytest.fixture
async def review(review_factory: Any) -> AsyncIterator[ReviewApp]:
    async with review_factory() as r:
        yield r
