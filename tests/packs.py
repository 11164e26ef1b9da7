"""Packs used only by the tests: a counter with a race window, and tools that fail on purpose."""

from __future__ import annotations

import asyncio
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from app.sdk import Pack, ToolContext, ToolError

counter_pack = Pack("counter", base=lambda resources: {"counters": {"main": {"value": 100}}})


@counter_pack.tool(mutates=True)
async def increment(ctx: ToolContext, by: int = 1, name: str = "main") -> dict[str, int]:
    """Add `by` to a counter and return its new value."""
    record = ctx.state.get("counters", name, {"value": 0})
    # Yield between the read and the write: without the rollout lock, parallel calls would lose updates.
    await asyncio.sleep(0.002)
    record["value"] += by
    ctx.state.put("counters", name, record)
    return {"value": record["value"]}


@counter_pack.tool
def read_counter(ctx: ToolContext, name: str = "main") -> dict[str, int]:
    """Read a counter."""
    return {"value": ctx.state.get("counters", name, {"value": 0})["value"]}


@counter_pack.tool(mutates=True)
def increment_then_fail(ctx: ToolContext) -> str:
    """Write, then refuse: the write must not be kept."""
    ctx.state.put("counters", "main", {"value": -1})
    raise ToolError("refused after writing")


class Mode(StrEnum):
    fast = "fast"
    slow = "slow"


class Address(BaseModel):
    city: str
    zip: Annotated[str, Field(description="Postal code.")]


faults_pack = Pack("faults")


@faults_pack.tool
def crash() -> str:
    """Raise an unexpected exception."""
    raise RuntimeError("boom")


@faults_pack.tool
def refuse(reason: str) -> str:
    """Raise a ToolError with the reason."""
    raise ToolError(reason)


@faults_pack.tool
def big_output(size: int) -> str:
    """Return `size` characters."""
    return "x" * size


@faults_pack.tool
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "done"


@faults_pack.tool
def shapes(
    query: Annotated[str, Field(description="What to look for.")],
    mode: Mode,
    kind: Literal["a", "b"],
    tags: list[str],
    address: Address | None = None,
    limit: int = 5,
) -> dict[str, object]:
    """Echo structured arguments back."""
    return {
        "query": query,
        "mode": mode.value,
        "kind": kind,
        "tags": tags,
        "address": address.model_dump() if address else None,
        "limit": limit,
    }
