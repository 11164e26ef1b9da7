"""The benchmark's pack (`SPARRING_PACKS=bench.bench_pack`): a trivial tool and one that changes state.

- `echo` is the trivial path: no `ToolContext`, no state; sparring still authenticates, validates,
  claims and answers the call in the ledger and logs it durably.
- `bump` is the full path: a `mutates=True` tool that reads one record of the rollout's state through
  `ctx.state`, changes it and writes it back, under the rollout's lock.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from app.sdk import Pack, ToolContext

pack = Pack(
    "bench",
    description="Benchmark tools: a trivial echo and a read-modify-write of one state record.",
    base=lambda resources: {"counters": {"main": {"value": 0, "last": ""}}},
)


@pack.tool
async def echo(text: Annotated[str, Field(description="Text to send back unchanged.")]) -> str:
    """Return the text unchanged."""
    return text


@pack.tool(mutates=True)
async def bump(
    ctx: ToolContext, text: Annotated[str, Field(description="Text remembered as the last one seen.")]
) -> dict[str, object]:
    """Add one to this rollout's counter, remember the text, and return the counter."""
    record = ctx.state.get("counters", "main", {"value": 0, "last": ""})
    record["value"] = int(record["value"]) + 1
    record["last"] = text
    ctx.state.put("counters", "main", record)
    return {"value": record["value"], "text": text}
