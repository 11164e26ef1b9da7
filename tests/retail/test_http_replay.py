"""Every train task replayed over HTTP, all rollouts at once, then graded by the `retail` state check."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.conftest import ADMIN_KEY, AppFactory, new_trace
from tools.retail import pack
from tools.retail.tasks import get_task, replay_calls, split_task_ids


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


async def run_task(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    """The task's gold calls in order under a fresh trace, then a retry of its last write, then the grade."""
    trace = new_trace()
    calls = replay_calls(task_id)
    outputs = [await send(client, trace, f"call_{i}", name, args) for i, (name, args) in enumerate(calls)]
    writes = [i for i, (name, _) in enumerate(calls) if pack.tools[name].mutates]
    retried = None
    if writes:
        # The platform retries a call whose answer it lost: the ledger answers it, nothing is applied twice.
        last = writes[-1]
        retried = (outputs[last], await send(client, trace, f"call_{last}", *calls[last]))
    answer = " ".join(get_task(task_id).evaluation_criteria.communicate_info) or "Done."
    graded = await client.post(
        "/grade/retail",
        json={"sample": {"output_text": answer}, "item": {"task_id": task_id}, "trace_id": trace},
    )
    assert graded.status_code == 200, graded.text
    return {"task": task_id, "score": graded.json()["score"], "retried": retried, "outputs": outputs}


async def test_every_train_task_replayed_concurrently_scores_1(
    app_factory: AppFactory, retail_data: Path
) -> None:
    tasks = split_task_ids("train")
    assert len(tasks) == 74
    async with app_factory(packs=[pack], key=ADMIN_KEY, retail_data=retail_data) as client:
        results = await asyncio.gather(*(run_task(client, task_id) for task_id in tasks))
    failed = [r["task"] for r in results if r["score"] != 1.0]
    assert failed == [], f"tasks whose replay did not reach the gold database: {failed}"
    retried = [r["retried"] for r in results if r["retried"] is not None]
    assert len(retried) > 50
    assert all(first == again for first, again in retried)


async def test_a_new_call_id_is_a_second_action(app_factory: AppFactory, retail_data: Path) -> None:
    # Task 0's first write exchanges the items of a delivered order; a second exchange is refused.
    calls = replay_calls("0")
    first_write = next(i for i, (name, _) in enumerate(calls) if pack.tools[name].mutates)
    async with app_factory(packs=[pack], key=ADMIN_KEY, retail_data=retail_data) as client:
        trace = new_trace()
        outputs = [
            await send(client, trace, f"call_{i}", n, a) for i, (n, a) in enumerate(calls[: first_write + 1])
        ]
        name, arguments = calls[first_write]
        replayed = await send(client, trace, f"call_{first_write}", name, arguments)
        second = await send(client, trace, "call_again", name, arguments)
        state = (await client.get(f"/rollouts/{trace}/state")).json()
    assert replayed == outputs[-1]
    assert second != outputs[-1] and second.startswith("Error:"), second
    changed = state["packs"]["retail"]["changed"]
    order_id = arguments["order_id"]
    assert changed["orders"][order_id]["status"] == "exchange requested"  # one exchange, kept
