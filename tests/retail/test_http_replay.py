"""Every train task replayed over HTTP, all rollouts at once, then graded by the `retail` state check."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson

from app.deps import app_state
from app.rollouts.store import RolloutStore
from tests.conftest import ADMIN_KEY, AppFactory, new_trace
from tests.retail.corpus import get_task, replay_calls, split_task_ids
from tools.retail import pack
from tools.retail.tasks import ToolCall


async def send(
    client: httpx.AsyncClient, trace: str, call_id: str, name: str, arguments: dict[str, Any]
) -> str:
    body = {
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": orjson.dumps(arguments).decode(),
        "trace_id": trace,
        "item": {},
    }
    response = await client.post("/tools", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["output"])


def mutates(call: ToolCall) -> bool:
    return pack.tools[call[0]].mutates


async def run_calls(client: httpx.AsyncClient, trace: str, calls: list[ToolCall]) -> list[str]:
    """The calls in order, call `i` as `call_i`; a run of reads goes out at once (parallel tool calls)."""
    outputs: list[str] = []
    start = 0
    while start < len(calls):
        end = start + 1
        if not mutates(calls[start]):
            while end < len(calls) and not mutates(calls[end]):
                end += 1
        outputs += await asyncio.gather(
            *(send(client, trace, f"call_{i}", *calls[i]) for i in range(start, end))
        )
        start = end
    return outputs


async def grade(client: httpx.AsyncClient, trace: str, task_id: str) -> dict[str, Any]:
    """The `retail` grade of the rollout, with a final answer that states every fact to communicate."""
    answer = "Done. " + " and ".join(get_task(task_id).evaluation_criteria.communicate_info)
    graded = await client.post(
        "/grade/retail",
        json={"sample": {"output_text": answer}, "item": {"task_id": task_id}, "trace_id": trace},
    )
    assert graded.status_code == 200, graded.text
    result: dict[str, Any] = graded.json()
    return result


async def state_of(client: httpx.AsyncClient, trace: str) -> Any:
    """The rollout's changed records, read from the server's store (the state route also materializes the
    whole database, which would dominate this test's time)."""
    store: RolloutStore = app_state(client.app).store  # type: ignore[attr-defined]
    return (await store.changes(trace)).get("retail", {})


async def run_task(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    """Two rollouts of a task: its gold calls (then a retry of its last write), and the gold calls minus
    the last write that succeeded. Both are graded by the `retail` state check."""
    calls = replay_calls(task_id)
    trace = new_trace()
    outputs = await run_calls(client, trace, calls)
    writes = [i for i, call in enumerate(calls) if mutates(call)]
    retried = None
    if writes:
        # The platform retries a call whose answer it lost: the ledger answers it, nothing is applied twice.
        last, before = writes[-1], await state_of(client, trace)
        again = await send(client, trace, f"call_{last}", *calls[last])
        retried = (outputs[last], again, before, await state_of(client, trace))
    full = await grade(client, trace, task_id)

    applied = [i for i in writes if not outputs[i].startswith("Error:")]
    dropped = None
    if applied:
        trace_without = new_trace()
        await run_calls(client, trace_without, calls[: applied[-1]] + calls[applied[-1] + 1 :])
        dropped = await grade(client, trace_without, task_id)
    return {"task": task_id, "full": full, "dropped": dropped, "retried": retried}


async def test_every_train_task_replayed_concurrently_scores_1(
    app_factory: AppFactory, retail_data: Path
) -> None:
    tasks = split_task_ids("train")
    assert len(tasks) == 74
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"retail": {"data": retail_data}}
    ) as client:
        results = await asyncio.gather(*(run_task(client, task_id) for task_id in tasks))

    failed = {r["task"]: r["full"] for r in results if r["full"]["score"] != 1.0}
    assert failed == {}, f"tasks whose replay did not reach the gold database: {failed}"

    dropped = [r for r in results if r["dropped"] is not None]
    assert len(dropped) >= 60  # most tasks change the database
    # The answer states every fact to communicate, so a 0 is the database check's.
    kept = [r["task"] for r in dropped if r["dropped"]["score"] != 0.0]
    assert kept == [], f"tasks that still scored without their last write: {kept}"

    retried = [r["retried"] for r in results if r["retried"] is not None]
    assert len(retried) >= len(dropped)
    for first, again, before, after in retried:
        assert again == first  # the stored answer, not a second run
        assert after == before  # and the rollout's database did not change


async def test_a_new_call_id_is_a_second_action(app_factory: AppFactory, retail_data: Path) -> None:
    # Task 0's first write exchanges the items of a delivered order; a second exchange is refused.
    calls = replay_calls("0")
    first_write = next(i for i, call in enumerate(calls) if mutates(call))
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"retail": {"data": retail_data}}
    ) as client:
        trace = new_trace()
        outputs = await run_calls(client, trace, calls[: first_write + 1])
        name, arguments = calls[first_write]
        replayed = await send(client, trace, f"call_{first_write}", name, arguments)
        second = await send(client, trace, "call_again", name, arguments)
        changed = await state_of(client, trace)
        logged = (await client.get(f"/rollouts/{trace}")).json()
    assert replayed == outputs[-1]
    assert second != outputs[-1] and second.startswith("Error:"), second
    order_id = arguments["order_id"]
    assert changed["orders"][order_id]["status"] == "exchange requested"  # one exchange, kept
    # The log holds the tool's two runs; the retry was answered from the ledger without running it.
    runs = [(c["call_id"], c["outcome"]) for c in logged["timeline"] if c["tool"] == name]
    assert runs == [(f"call_{first_write}", "ok"), ("call_again", "model_error")]
