"""`sparring mcp`: the registry as a local MCP server over stdio (desktop agents, IDEs).

The app's own lifespan builds everything (database, store, log writer, call service), so a call over
stdio is validated, stored, deduplicated and logged exactly as over HTTP; the process is one session,
so one rollout, labelled `local` unless told otherwise. With `pack`, the server shows and calls that
pack's tools only (as /packs/<pack>/mcp does over HTTP).
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI
from mcp.server.stdio import stdio_server

from app.deps import app_state
from app.mcp.server import Caller, McpGateway

DEFAULT_RUN = "local"


async def serve_stdio(
    app: FastAPI, *, trace_id: str | None = None, run: str = DEFAULT_RUN, pack: str | None = None
) -> None:
    async with app.router.lifespan_context(app):
        session = uuid.uuid4().hex
        caller = Caller(trace_id=trace_id or f"trace_mcp_{session}", run=run, session=session, pack=pack)
        state = app_state(app)
        gateway = McpGateway(
            state.registry,
            state.call_service,
            lambda _ctx: caller,
            retry_after=state.settings.retry_after_seconds,
        )
        async with stdio_server() as (read_stream, write_stream):
            await gateway.server.run(
                read_stream, write_stream, gateway.server.create_initialization_options()
            )
