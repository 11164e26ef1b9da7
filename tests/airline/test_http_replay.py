"""Every gold action of the airline test split replayed over HTTP on Postgres + Redis, against τ²-bench's own
environment and evaluators run from the wheel: the same outputs, the same final database, the same reward."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.deps import app_state
from app.rollouts.store import RolloutStore
from tests.airline import corpus, reference
from tests.conftest import ADMIN_KEY, AppFactory, new_trace
from tests.retail.test_http_replay import send
from tools.airline import pack
from tools.airline.tasks import ToolCall

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("backend", ["real"])]


async def rollout(client: httpx.AsyncClient, calls: list[ToolCall]) -> tuple[str, list[str]]:
    """The calls in order under a fresh trace id, one at a time (as the airline policy asks)."""
    trace = new_trace()
    outputs = [
        await send(client, trace, f"call_{i}", name, arguments) for i, (name, arguments) in enumerate(calls)
    ]
    return trace, outputs


async def changes(client: httpx.AsyncClient, trace: str) -> Any:
    store: RolloutStore = app_state(client.app).store  # type: ignore[attr-defined]
    return (await store.changes(trace)).get("airline", {})


async def grade(client: httpx.AsyncClient, trace: str, task_id: str) -> float:
    graded = await client.post(
        "/grade/airline",
        json={
            "sample": {"output_text": corpus.answer_for(task_id)},
            "item": {"task_id": task_id},
            "trace_id": trace,
        },
    )
    assert graded.status_code == 200, graded.text
    score: float = graded.json()["score"]
    return score


def without_last_write(calls: list[ToolCall], outputs: list[str]) -> list[ToolCall] | None:
    applied = [
        i
        for i, (name, _) in enumerate(calls)
        if pack.tools[name].mutates and not outputs[i].startswith("Error:")
    ]
    return calls[: applied[-1]] + calls[applied[-1] + 1 :] if applied else None


async def run_task(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    calls = corpus.gold_calls(task_id)
    trace, outputs = await rollout(client, calls)
    result: dict[str, Any] = {
        "task": task_id,
        "calls": calls,
        "outputs": outputs,
        "changes": await changes(client, trace),
        "score": await grade(client, trace, task_id),
        "dropped": None,
    }
    shorter = without_last_write(calls, outputs)
    if shorter is not None:
        trace_without, outputs_without = await rollout(client, shorter)
        result["dropped"] = (shorter, outputs_without, await grade(client, trace_without, task_id))
    return result


async def test_the_test_split_replayed_over_http_is_the_references(
    app_factory: AppFactory, airline_data: Path
) -> None:
    tasks = corpus.split_task_ids("test")
    assert len(tasks) == 20
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"airline": {"data": airline_data}}
    ) as client:
        results = await asyncio.gather(*(run_task(client, task_id) for task_id in tasks))

    dropped = 0
    for result in results:
        task_id, calls, outputs = result["task"], result["calls"], result["outputs"]
        theirs = reference.run(calls)
        assert outputs == theirs.outputs, task_id
        assert corpus.database_text(result["changes"]) == theirs.database, task_id
        answer = corpus.answer_for(task_id)
        assert result["score"] == reference.reward(task_id, calls, outputs, answer) == 1.0, task_id
        if result["dropped"] is not None:
            dropped += 1
            shorter, outputs_without, score = result["dropped"]
            assert outputs_without == reference.run(shorter).outputs, task_id
            assert score == reference.reward(task_id, shorter, outputs_without, answer) == 0.0, task_id
    assert dropped >= 10  # most tasks change the database
