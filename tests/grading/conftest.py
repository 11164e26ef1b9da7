"""Fixtures of the grading tests: a judge server on loopback, a python worker pool, a grader context."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from app.grading.graders.judge import JudgeSettings
from app.grading.graders.python_pool import PythonPool, PythonPoolSettings
from app.grading.graders.registry import GraderContext
from tests.grading.judge_server import JudgeServer

# A timeout no normal grade gets near, even on a busy machine; the timeout test uses its own pool.
POOL = PythonPoolSettings(workers=2, timeout=10.0, memory_mb=256)


@pytest.fixture(scope="session")
def judge_server() -> Iterator[JudgeServer]:
    server = JudgeServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def python_pool() -> AsyncIterator[PythonPool]:
    pool = PythonPool(POOL)
    yield pool
    await pool.aclose()


@pytest.fixture
async def context() -> AsyncIterator[GraderContext]:
    """A context with no judge configured (model graders are refused) and a small python pool."""
    ctx = GraderContext(python=POOL)
    yield ctx
    await ctx.aclose()


@pytest.fixture
async def judge_context(judge_server: JudgeServer) -> AsyncIterator[GraderContext]:
    """A context whose judge is the test server (no retries: outages fail fast)."""
    ctx = GraderContext(
        judge=JudgeSettings(base_url=judge_server.base_url, api_key="test", timeout=5.0, max_retries=0),
        python=POOL,
    )
    yield ctx
    await ctx.aclose()
