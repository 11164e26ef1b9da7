"""Reading the call log in tests: the tool_calls rows of some rollouts, on any engine."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

COLUMNS = "trace_id, call_id, tool, arguments, output, outcome, status_code, worker"


async def logged_calls_on(
    engine: AsyncEngine, traces: Iterable[str], *, chunk: int = 200
) -> list[dict[str, Any]]:
    """tool_calls rows of these rollouts (in no particular order), read in chunks of `chunk` trace ids."""
    traces = list(traces)
    rows: list[dict[str, Any]] = []
    async with engine.connect() as conn:
        for start in range(0, len(traces), chunk):
            part = traces[start : start + chunk]
            params = {f"t{i}": t for i, t in enumerate(part)}
            placeholders = ", ".join(f":t{i}" for i in range(len(part)))
            result = await conn.execute(
                text(f"SELECT {COLUMNS} FROM tool_calls WHERE trace_id IN ({placeholders})"), params
            )
            rows.extend(dict(r._mapping) for r in result)
    return rows
