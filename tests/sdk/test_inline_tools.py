"""Where a synchronous tool runs: a worker thread by default, the event loop's thread with inline=True."""

from __future__ import annotations

import threading

from app.sdk import Pack, ToolContext
from tests.conftest import AppFactory, call_body, new_trace

pack = Pack("threads", description="Report the thread a tool ran in.")


@pack.tool
def in_thread(ctx: ToolContext) -> str:
    """Name the thread this call ran in."""
    return threading.current_thread().name


@pack.tool(inline=True, mutates=True)
def on_loop(ctx: ToolContext) -> str:
    """Name the thread this call ran in, and write the state."""
    ctx.state.put("seen", ctx.call_id or "", True)
    return threading.current_thread().name


async def test_inline_tools_run_on_the_event_loop_and_others_in_a_worker_thread(
    app_factory: AppFactory,
) -> None:
    loop_thread = threading.current_thread().name
    trace = new_trace()
    async with app_factory(packs=[pack]) as client:
        inline = await client.post("/tools/on_loop", json=call_body("{}", trace_id=trace, call_id="c1"))
        threaded = await client.post("/tools/in_thread", json=call_body("{}", trace_id=trace, call_id="c2"))
        again = await client.post("/tools/on_loop", json=call_body("{}", trace_id=trace, call_id="c1"))
    assert inline.status_code == threaded.status_code == 200, (inline.text, threaded.text)
    assert inline.json()["output"] == loop_thread
    assert threaded.json()["output"] != loop_thread
    # Inline or not, the call goes through the ledger: a retry is answered from it.
    assert again.json() == inline.json()
