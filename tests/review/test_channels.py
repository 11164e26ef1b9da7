"""A training run (the tool routes) beside a production run (MCP) in the review API and pages."""

from __future__ import annotations

import uuid

from tests.mcp.conftest import in_process, mcp_client
from tests.review.conftest import ADMIN, ReviewApp
from tests.review.test_ui_auth import login


async def two_runs(review: ReviewApp) -> tuple[str, str, list[str], list[str]]:
    """A training run over HTTP (2 rollouts) and a production run over MCP (3 sessions) of the counter."""
    train, production = f"train-{uuid.uuid4().hex[:6]}", f"prod-{uuid.uuid4().hex[:6]}"
    train_traces = [f"trace_{uuid.uuid4().hex}" for _ in range(2)]
    for trace in train_traces:
        for i in range(2):
            r = await review.call("increment", {"by": 1}, trace, call_id=f"c{i}", run=train)
            assert r.status_code == 200
    production_traces = [f"trace_{uuid.uuid4().hex}" for _ in range(3)]
    for trace in production_traces:
        headers = {"X-Sparring-Run": production, "X-Sparring-Trace-Id": trace}
        async with mcp_client(
            "http://127.0.0.1/mcp", transport=in_process(review.app), headers=headers
        ) as mcp:
            await mcp.call_tool("increment", {"by": 1})
            await mcp.call_tool("read_counter", {})
            await mcp.call_tool("increment", {"by": "two"})  # a model mistake: drift shows here
    return train, production, train_traces, production_traces


async def test_rollouts_and_runs_filter_by_channel(review: ReviewApp) -> None:
    train, production, train_traces, production_traces = await two_runs(review)
    page = await review.api("/review/api/rollouts", channel="mcp", limit=500)
    mcp_traces = {r["trace_id"] for r in page["rollouts"]}
    assert set(production_traces) <= mcp_traces and not mcp_traces & set(train_traces)
    assert {r["channel"] for r in page["rollouts"]} == {"mcp"}
    page = await review.api("/review/api/rollouts", run=train, channel="rft")
    assert {r["trace_id"] for r in page["rollouts"]} == set(train_traces)
    assert (await review.api("/review/api/rollouts", run=train, channel="mcp"))["rollouts"] == []
    bad = await review.client.get("/review/api/rollouts", params={"channel": "smtp"}, headers=ADMIN)
    assert bad.status_code == 422

    runs = {r["run"]: r for r in await review.api("/review/api/runs")}
    assert runs[train]["channels"] == {"rft": 2} and runs[production]["channels"] == {"mcp": 3}
    assert runs[production]["rollouts"] == 3
    only_mcp = {r["run"] for r in await review.api("/review/api/runs", channel="mcp")}
    assert production in only_mcp and train not in only_mcp

    await login(review)
    html = (await review.client.get("/review", params={"channel": "mcp", "run": production})).text
    assert all(trace in html for trace in production_traces)
    assert not any(trace in html for trace in train_traces)
    runs_page = (await review.client.get("/review/runs")).text
    assert "mcp 3" in runs_page and "rft 2" in runs_page


async def test_compare_puts_a_training_run_beside_a_production_run(review: ReviewApp) -> None:
    train, production, _, _ = await two_runs(review)
    comparison = await review.api("/review/api/compare", a=train, b=production)
    a, b = comparison["a"], comparison["b"]
    assert (a["channels"], b["channels"]) == ({"rft": 2}, {"mcp": 3})
    assert (a["calls_per_rollout"], b["calls_per_rollout"]) == (2.0, 3.0)
    assert comparison["calls_per_rollout_delta"] == 1.0
    assert (a["model_errors"], b["model_errors"]) == (0, 3)
    assert (a["model_error_share"], b["model_error_share"]) == (0.0, 1 / 3)
    mix = {t["tool"]: (t["calls_a"], t["calls_b"]) for t in comparison["tool_mix"]}
    assert mix == {"increment": (4, 6), "read_counter": (0, 3)}
    assert a["latency"]["p50_ms"] is not None and b["latency"]["p50_ms"] is not None

    await login(review)
    page = (await review.client.get("/review/compare", params={"a": train, "b": production})).text
    assert '<td class="channels">rft 2</td><td class="channels">mcp 3</td>' in page
    assert '<td class="num" id="model-errors-b">3 (33.3%)</td>' in page


async def test_a_rollout_graded_without_calls_is_counted_and_filtered_alike(review: ReviewApp) -> None:
    # Graded with no call logged, the rollout's row has no channel: the runs list counts it under rft,
    # so filtering by rft must find it too (the counts and the lists must agree).
    run = f"train-{uuid.uuid4().hex[:6]}"
    called, uncalled = f"trace_{uuid.uuid4().hex}", f"trace_{uuid.uuid4().hex}"
    assert (await review.call("increment", {"by": 1}, called, call_id="c0", run=run)).status_code == 200
    await review.grade(called, answer="1", score=1.0, run=run)
    await review.grade(uncalled, answer="1", score=1.0, run=run)

    runs = {r["run"]: r for r in await review.api("/review/api/runs")}
    assert runs[run]["channels"] == {"rft": 2}
    only_rft = {r["run"]: r for r in await review.api("/review/api/runs", channel="rft")}
    assert only_rft[run]["rollouts"] == 2
    page = await review.api("/review/api/rollouts", run=run, channel="rft", count="true")
    assert {r["trace_id"] for r in page["rollouts"]} == {called, uncalled} and page["total"] == 2
    assert (await review.api("/review/api/rollouts", run=run, channel="mcp"))["rollouts"] == []
