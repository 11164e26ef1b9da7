"""Every gold action of the telecom test split (both sides: the agent's carrier tools and the user's phone)
replayed over HTTP, against τ²-bench's own environment and evaluators run from the wheel: the same outputs,
the same final carrier records and phone, the same reward; without its last action, τ²-bench's reward too."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from app.deps import app_state
from app.rollouts.store import RolloutStore
from tests.conftest import ADMIN_KEY, AppFactory, new_trace
from tests.telecom import corpus, reference
from tests.telecom.corpus import Call
from tools.telecom import pack

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("backend", ["embedded", "real"], indirect=True)]


async def send(client: httpx.AsyncClient, trace: str, call_id: str, call: Call, task_id: str) -> str:
    requestor, name, arguments = call
    route = f"/user-tools/{name}" if requestor == "user" else f"/tools/{name}"
    body = {
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": orjson.dumps(arguments).decode(),
        "trace_id": trace,
        "item": {"task_id": task_id},
    }
    response = await client.post(route, json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["output"])


async def rollout(client: httpx.AsyncClient, task_id: str, calls: list[Call]) -> tuple[str, list[str]]:
    """The calls in order under a fresh trace id, one at a time (each side waits for its answer)."""
    trace = new_trace()
    outputs = [await send(client, trace, f"call_{i}", call, task_id) for i, call in enumerate(calls)]
    return trace, [corpus.masked(output) for output in outputs]


async def grade(client: httpx.AsyncClient, trace: str, task_id: str) -> float:
    graded = await client.post(
        "/grade/telecom",
        json={"sample": {"output_text": "Done."}, "item": {"task_id": task_id}, "trace_id": trace},
    )
    assert graded.status_code == 200, graded.text
    score: float = graded.json()["score"]
    return score


async def run_task(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    calls = corpus.gold_calls(task_id)
    trace, outputs = await rollout(client, task_id, calls)
    store: RolloutStore = app_state(client.app).store  # type: ignore[attr-defined]
    result: dict[str, Any] = {
        "task": task_id,
        "calls": calls,
        "outputs": outputs,
        "state": corpus.state_text((await store.changes(trace)).get("telecom", {})),
        "score": await grade(client, trace, task_id),
        "dropped": None,
    }
    if calls:
        shorter = calls[:-1]
        trace_without, outputs_without = await rollout(client, task_id, shorter)
        if not shorter:  # a rollout that never called a tool: its first call never came
            outputs_without = []
        result["dropped"] = (shorter, outputs_without, await grade(client, trace_without, task_id))
    return result


async def test_the_test_split_replayed_over_http_is_the_references(
    app_factory: AppFactory, telecom_data: Path
) -> None:
    tasks = corpus.split_task_ids("test")
    assert len(tasks) == 40
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"telecom": {"data": telecom_data}}
    ) as client:
        results = await asyncio.gather(*(run_task(client, task_id) for task_id in tasks))

    zeros = 0
    for result in results:
        task_id, calls, outputs = result["task"], result["calls"], result["outputs"]
        theirs = reference.run(task_id, calls)
        assert outputs == theirs.outputs, task_id
        assert result["state"] == theirs.state, task_id
        assert result["score"] == reference.reward(task_id, calls, outputs) == 1.0, task_id
        if result["dropped"] is not None:
            shorter, outputs_without, score = result["dropped"]
            assert outputs_without == reference.run(task_id, shorter).outputs, task_id
            assert score == reference.reward(task_id, shorter, outputs_without), task_id
            zeros += score == 0.0
    assert zeros >= 30  # a fix without its last step leaves the customer's problem unsolved
