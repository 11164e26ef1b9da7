"""Group commit: concurrent calls share transactions, and each answer waits for its own commit."""

from __future__ import annotations

import asyncio

import httpx
from sqlalchemy import func, select

from app.db.models import Rollout, ToolCall
from tests.conftest import call_body, new_trace


async def test_concurrent_calls_share_commits_and_all_are_logged(client: httpx.AsyncClient) -> None:
    app = client.app  # type: ignore[attr-defined]
    traces = [new_trace() for _ in range(10)]
    registry = app.state.metrics.registry
    before = registry.get_sample_value("sparring_log_batch_size_sum")  # rows committed so far
    batches_before = registry.get_sample_value("sparring_log_batch_size_count")
    results = await asyncio.gather(
        *(
            client.post("/tools/read_counter", json=call_body("{}", trace_id=traces[i % 10], call_id=f"c{i}"))
            for i in range(80)
        )
    )
    assert all(r.status_code == 200 for r in results)
    rows = registry.get_sample_value("sparring_log_batch_size_sum") - before
    batches = registry.get_sample_value("sparring_log_batch_size_count") - batches_before
    assert rows == 80
    assert batches < 80, "80 simultaneous calls must not need 80 transactions"
    async with app.state.sessionmaker() as session:
        logged = await session.scalar(
            select(func.count()).select_from(ToolCall).where(ToolCall.trace_id.in_(traces))
        )
        rollouts = await session.scalar(
            select(func.count()).select_from(Rollout).where(Rollout.trace_id.in_(traces))
        )
    assert logged == 80
    assert rollouts == 10


async def test_rollout_row_keeps_first_and_last_seen_and_run(client: httpx.AsyncClient) -> None:
    app = client.app  # type: ignore[attr-defined]
    trace = new_trace()
    item = {"task_id": 7, "messages": []}
    for i in range(3):
        r = await client.post(
            "/tools/read_counter",
            json=call_body("{}", trace_id=trace, call_id=f"c{i}", item=item),
            headers={"X-Sparring-Run": "baseline-1"},
        )
        assert r.status_code == 200
    async with app.state.sessionmaker() as session:
        rollout = await session.get(Rollout, trace)
        calls = (await session.scalars(select(ToolCall).where(ToolCall.trace_id == trace))).all()
    assert rollout is not None
    assert rollout.run == "baseline-1" and rollout.item_key == "task_id:7"
    assert rollout.first_seen == min(c.started_at for c in calls)
    assert rollout.last_seen == max(c.ended_at for c in calls)


async def test_the_rollout_counts_its_logged_calls_and_each_output_size(client: httpx.AsyncClient) -> None:
    trace = new_trace()

    async def call(call_id: str, by: int) -> str:
        body = call_body({"by": by}, trace_id=trace, call_id=call_id)
        response = await client.post("/tools/increment", json=body)
        assert response.status_code == 200, response.text
        return str(response.json()["output"])

    # Parallel calls of one rollout land in one or several batches; retries are replayed, not logged.
    outputs = await asyncio.gather(*(call(f"c{i}", 1) for i in range(6)))
    await asyncio.gather(call("c0", 1), call("c1", 1))
    async with client.app.state.sessionmaker() as session:  # type: ignore[attr-defined]
        rollout = await session.get(Rollout, trace)
        sizes = (await session.scalars(select(ToolCall.output_bytes).where(ToolCall.trace_id == trace))).all()
    assert rollout is not None and rollout.calls == 6
    assert sorted(sizes) == sorted(len(o.encode()) for o in outputs)
