"""Export: GET /export and `sparring export` write the same JSONL (a rollout a line); the seed."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from app.config import get_settings
from app.deps import app_state
from app.review.cli import review_cli
from app.review.seed import SeedSpec, generate, seed_run
from tests.conftest import new_trace
from tests.review.conftest import ADMIN, ReviewApp


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, backend_settings: dict[str, Any], tmp_path: Path) -> None:
    monkeypatch.setenv("SPARRING_DATABASE_URL", backend_settings["database_url"])
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "cli-home"))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def invoke(*args: str) -> Any:
    result = CliRunner().invoke(review_cli, list(args))
    assert result.exit_code == 0, result.output
    return result


async def test_export_round_trip_over_http_and_the_cli(
    review: ReviewApp, cli_env: None, tmp_path: Path
) -> None:
    spec = replace(SeedSpec(rollouts=12, items=4, max_calls=5), run=f"run-{uuid.uuid4().hex[:8]}")
    await seed_run(app_state(review.app).engine, spec)
    trace = new_trace()
    await review.call("echo", {"text": "hello"}, trace, call_id="c1", run=spec.run, item={"id": "live"})
    await review.call("crash", {}, trace, call_id="c2", run=spec.run)
    await review.grade(trace, answer="hello", score=1.0, item={"id": "live"}, run=spec.run)

    response = await review.client.get("/export", params={"run": spec.run}, headers=ADMIN)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-ndjson"
    assert f'filename="sparring-{spec.run}.jsonl"' in response.headers["content-disposition"]
    lines = [orjson.loads(line) for line in response.content.splitlines()]
    assert len(lines) == 13 and all(line["run"] == spec.run for line in lines)
    assert [line["trace_id"] for line in lines] == sorted(line["trace_id"] for line in lines)

    live = next(line for line in lines if line["trace_id"] == trace)
    assert [(c["seq"], c["tool"], c["outcome"]) for c in live["calls"]] == [
        (0, "echo", "ok"),
        (1, "crash", "tool_crash"),
    ]
    assert live["calls"][0]["output"] == "hello" and live["calls"][0]["arguments"] == '{"text":"hello"}'
    (grade,) = live["grades"]
    assert (
        grade["score"] == 1.0
        and grade["sample"] == {"output_text": "hello"}
        and grade["item_key"] == "id:live"
    )
    assert [f["name"] for f in grade["flags"]] == ["tool_errors"]
    # The export agrees with the generated data and with the timeline API.
    _, calls, _ = generate(spec)
    assert sum(len(line["calls"]) for line in lines if line["trace_id"] != trace) == len(calls)
    timeline = (await review.client.get(f"/review/api/rollouts/{trace}", headers=ADMIN)).json()
    assert [c["tool"] for c in timeline["timeline"]] == [c["tool"] for c in live["calls"]]

    out = tmp_path / "export.jsonl"
    result = await asyncio.to_thread(invoke, "export", "--run", spec.run, "--out", str(out))
    assert f"exported 13 rollouts to {out}" in result.output
    assert out.read_bytes() == response.content


async def test_cli_recomputes_the_flags_of_a_run(review: ReviewApp, cli_env: None) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    trace = new_trace()
    for i in range(3):
        await review.call("read_counter", {}, trace, call_id=f"c{i}", run=run)
    await review.grade(trace, answer="The counter is at 100.", score=1.0, run=run)
    async with review.sessions() as session, session.begin():
        from sqlalchemy import update

        from app.db.models import Grade

        await session.execute(update(Grade).where(Grade.trace_id == trace).values(flags=[]))
    result = await asyncio.to_thread(invoke, "recompute-flags", "--run", run)
    assert "recomputed the flags of 1 rollouts" in result.output
    timeline = (await review.client.get(f"/review/api/rollouts/{trace}", headers=ADMIN)).json()
    assert [f["name"] for f in timeline["grades"][0]["flags"]] == ["repeated_call"]


async def test_seed_inserts_what_it_generates(review: ReviewApp, cli_env: None) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    result = await asyncio.to_thread(
        invoke, "seed-rollouts", "--run", run, "--rollouts", "30", "--items", "5", "--scores", "known"
    )
    assert "inserted 30 rollouts" in result.output
    spec = SeedSpec(run=run, rollouts=30, items=5, trace_prefix="seed7")
    rollouts, calls, grades = generate(spec)
    stats = (await review.client.get("/review/api/stats", params={"run": run}, headers=ADMIN)).json()
    assert stats["rollouts"] == 30 and stats["reward"]["graded"] == 30
    assert sum(t["calls"] for t in stats["tools"]) == len(calls)
    assert stats["items"]["items"] == 5
    assert (stats["items"]["always_zero"], stats["items"]["always_one"]) == (2, 2)
    page = (
        await review.client.get("/review/api/rollouts", params={"run": run, "limit": 1}, headers=ADMIN)
    ).json()
    assert page["rollouts"][0]["trace_id"] == rollouts[-1]["trace_id"]
    assert page["rollouts"][0]["flags"] == [f["name"] for f in grades[-1]["flags"]]


async def test_seeded_demo_runs_differ_by_seed_and_learn(review: ReviewApp, cli_env: None) -> None:
    runs = {}
    for seed in ("7", "8"):
        run = f"run-{uuid.uuid4().hex[:8]}"
        result = await asyncio.to_thread(
            invoke, "seed-rollouts", "--run", run, "--rollouts", "300", "--items", "20", "--seed", seed
        )
        assert "inserted 300 rollouts" in result.output
        runs[seed] = run
    params = {"a": runs["7"], "b": runs["8"]}
    comparison = (await review.client.get("/review/api/compare", params=params, headers=ADMIN)).json()
    assert comparison["reward_delta"] != 0
    assert comparison["items"]["improved"] > 0 and comparison["items"]["regressed"] > 0
    for run in runs.values():
        curve = (
            await review.client.get(
                "/review/api/curve", params={"run": run, "axis": "order", "windows": 3}, headers=ADMIN
            )
        ).json()
        means = [w["reward_mean"] for w in curve["windows"]]
        assert means[-1] > means[0], means  # the learnable items improve over the run
    spec = SeedSpec(run=runs["8"], rollouts=300, items=20, seed=8, scores="learning", trace_prefix="seed8")
    _, _, grades = generate(spec)
    stats = (await review.client.get("/review/api/stats", params={"run": runs["8"]}, headers=ADMIN)).json()
    assert stats["reward"]["mean"] == pytest.approx(sum(g["score"] for g in grades) / 300)
