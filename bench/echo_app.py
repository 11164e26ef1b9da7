"""The same-run baseline: a bare FastAPI app answering the tool-call envelope, echoing the arguments.

It is written the way a plain FastAPI service would be (a pydantic body model, a response model) and
does nothing else: no authentication, no validation of the arguments, no state, no log. Served with
the same uvicorn settings as sparring, it measures what FastAPI + uvicorn cost on this machine.

    uvicorn bench.echo_app:app
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str | None = None
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: Any = None
    trace_id: str | None = None


class FunctionCallOutput(BaseModel):
    type: str = "function_call_output"
    call_id: str | None
    id: str | None
    output: str


def output_of(arguments: Any) -> str:
    if arguments is None:
        return ""
    return arguments if isinstance(arguments, str) else str(arguments)


app = FastAPI(title="bench echo", docs_url=None, redoc_url=None, openapi_url=None)


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/tools/{name}")
async def call_tool(name: str, call: FunctionCall) -> FunctionCallOutput:
    return FunctionCallOutput(call_id=call.call_id, id=call.id, output=output_of(call.arguments))
