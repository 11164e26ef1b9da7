"""Reading the call log in tests: the calls of some rollouts as read (app/db/call_log.py), on any engine."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db.call_log import stands
from app.db.models import ToolCall

COLUMNS = ("trace_id", "call_id", "tool", "arguments", "output", "outcome", "status_code", "worker")


async def logged_calls_on(
    engine: AsyncEngine, traces: Iterable[str], *, chunk: int = 200, attempts: bool = False
) -> list[dict[str, Any]]:
    """The calls of these rollouts as read (in no particular order): a call's answer once, whatever its
    replays, and every failure; with `attempts`, every logged attempt. Read `chunk` trace ids at a time."""
    traces = list(traces)
    columns = [ToolCall.__table__.c[name] for name in COLUMNS]
    rows: list[dict[str, Any]] = []
    async with engine.connect() as conn:
        for start in range(0, len(traces), chunk):
            query = select(*columns).where(ToolCall.trace_id.in_(traces[start : start + chunk]))
            if not attempts:
                query = query.where(stands())
            rows.extend(dict(r._mapping) for r in await conn.execute(query))
    return rows
