"""A second baseline: the echo plus what a naive stateful handler does per call.

One Redis INCR (the rollout's "state") and one single-row Postgres INSERT in its own transaction
(the "log"), awaited before answering. No ledger, no lock, no batching: the cost a straightforward
implementation pays, against which sparring's full path is judged.

    BENCH_NAIVE_DATABASE_URL=postgresql+asyncpg://... BENCH_NAIVE_REDIS_URL=redis://.../13 \
        uvicorn bench.naive_app:app
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

from fastapi import FastAPI, Request
from redis.asyncio import BlockingConnectionPool, Redis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from bench.echo_app import FunctionCall, FunctionCallOutput, output_of

TABLE = "bench_naive_calls"

_CREATE = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    id BIGSERIAL PRIMARY KEY,
    trace_id VARCHAR(128) NOT NULL,
    call_id VARCHAR(200),
    tool VARCHAR(128) NOT NULL,
    arguments TEXT NOT NULL,
    output TEXT NOT NULL,
    created_at TIMESTAMPTZ NOT NULL
)
"""

_INSERT = text(
    f"INSERT INTO {TABLE} (trace_id, call_id, tool, arguments, output, created_at) "
    "VALUES (:trace_id, :call_id, :tool, :arguments, :output, :created_at)"
)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = create_async_engine(
        os.environ["BENCH_NAIVE_DATABASE_URL"], pool_size=32, max_overflow=0, pool_timeout=10
    )
    pool = BlockingConnectionPool.from_url(os.environ["BENCH_NAIVE_REDIS_URL"], max_connections=64)
    redis = Redis(connection_pool=pool)
    async with engine.begin() as conn:
        await conn.execute(text(_CREATE))
    app.state.engine = engine
    app.state.redis = redis
    try:
        yield
    finally:
        await redis.aclose()
        await engine.dispose()


app = FastAPI(title="bench naive", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/tools/{name}")
async def call_tool(name: str, call: FunctionCall, request: Request) -> FunctionCallOutput:
    engine: AsyncEngine = request.app.state.engine
    redis: Redis = request.app.state.redis
    trace_id = call.trace_id or "anonymous"
    output = output_of(call.arguments)
    await redis.incr(f"naive:{trace_id}")
    async with engine.begin() as conn:
        await conn.execute(
            _INSERT,
            {
                "trace_id": trace_id,
                "call_id": call.call_id,
                "tool": name,
                "arguments": output,
                "output": output,
                "created_at": datetime.now(UTC),
            },
        )
    return FunctionCallOutput(call_id=call.call_id, id=call.id, output=output)
