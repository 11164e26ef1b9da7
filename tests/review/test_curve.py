"""The learning curve: windows of time or of rollout order, checked against the generated data."""

from __future__ import annotations

import math
import uuid
from collections import defaultdict
from dataclasses import replace
from typing import Any

import pytest

from app.deps import app_state
from app.review.seed import SeedSpec, generate, seed_run
from tests.review.conftest import ReviewApp
from tests.review.test_ui_auth import login

SPEC = SeedSpec(rollouts=60, items=6, min_calls=0, max_calls=9, crash_share=0.05)


def expected_windows(spec: SeedSpec, window_of: dict[str, int]) -> dict[int, dict[str, Any]]:
    rollouts, calls, grades = generate(spec)
    score = {g["trace_id"]: g["score"] for g in grades}
    flags = {g["trace_id"]: {f["name"] for f in g["flags"]} for g in grades}
    errors: dict[str, int] = defaultdict(int)
    for c in calls:
        if c["outcome"] in ("tool_crash", "infra_error"):
            errors[c["trace_id"]] += 1
    members: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rollouts:
        members[window_of[r["trace_id"]]].append(r)
    out = {}
    for index, rows in members.items():
        scores = [score[r["trace_id"]] for r in rows]
        mean = sum(scores) / len(scores)
        flag_counts: dict[str, int] = defaultdict(int)
        for r in rows:
            for name in flags[r["trace_id"]]:
                flag_counts[name] += 1
        out[index] = {
            "rollouts": len(rows),
            "reward_mean": mean,
            "reward_std": math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores)),
            "calls_per_rollout": sum(r["calls"] for r in rows) / len(rows),
            "tool_errors": sum(errors[r["trace_id"]] for r in rows),
            "flags": dict(flag_counts),
        }
    return out


def check(curve: dict[str, Any], expected: dict[int, dict[str, Any]]) -> None:
    assert [w["index"] for w in curve["windows"]] == sorted(expected)
    for w in curve["windows"]:
        want = expected[w["index"]]
        assert w["rollouts"] == want["rollouts"] and w["scored"] == want["rollouts"]
        assert w["reward_mean"] == pytest.approx(want["reward_mean"])
        assert w["reward_std"] == pytest.approx(want["reward_std"], abs=1e-6)
        assert w["calls_per_rollout"] == pytest.approx(want["calls_per_rollout"])
        assert w["tool_errors"] == want["tool_errors"]
        assert w["flags"] == want["flags"]


async def test_windows_of_rollout_order(review: ReviewApp) -> None:
    spec = replace(SPEC, run=f"run-{uuid.uuid4().hex[:8]}")
    await seed_run(app_state(review.app).engine, spec)
    curve = await review.api("/review/api/curve", run=spec.run, axis="order", windows=8)
    # ntile: 60 rollouts in 8 windows, the first 4 of 8 and the last 4 of 7, in start order.
    sizes = [8, 8, 8, 8, 7, 7, 7, 7]
    window_of = {}
    r = 0
    for index, size in enumerate(sizes):
        for _ in range(size):
            window_of[f"seed_{spec.run}_{r:07d}"] = index
            r += 1
    check(curve, expected_windows(spec, window_of))
    assert curve["axis"] == "order" and curve["grader"] is None


async def test_windows_of_time(review: ReviewApp) -> None:
    spec = replace(SPEC, run=f"run-{uuid.uuid4().hex[:8]}")
    await seed_run(app_state(review.app).engine, spec)
    curve = await review.api("/review/api/curve", run=spec.run, windows=7)
    # Rollouts start 3 s apart: 0 .. 177 s in 7 windows of 177/7 s.
    window_of = {f"seed_{spec.run}_{r:07d}": min(6, math.floor(3 * r / (177 / 7))) for r in range(60)}
    check(curve, expected_windows(spec, window_of))
    first, last = curve["windows"][0], curve["windows"][-1]
    assert first["start"].startswith("2026-01-01T00:00:00") and last["end"].startswith("2026-01-01T00:02:57")
    names = [n for w in curve["windows"] for n in w["flags"]]
    assert set(curve["flag_names"]) == set(names)


async def test_a_rollout_on_a_window_s_edge_starts_that_window(review: ReviewApp) -> None:
    # Rollouts 3 s apart in windows of 3 s: each starts its window (the last shares the last one), on
    # SQLite as on Postgres (julianday's days lost the exact seconds: rollouts fell a window early).
    spec = replace(SPEC, run=f"run-{uuid.uuid4().hex[:8]}")
    await seed_run(app_state(review.app).engine, spec)
    curve = await review.api("/review/api/curve", run=spec.run, windows=59)
    window_of = {f"seed_{spec.run}_{r:07d}": min(58, r) for r in range(60)}
    check(curve, expected_windows(spec, window_of))


async def test_the_grader_chooses_the_scores_of_the_curve(review: ReviewApp) -> None:
    spec = replace(SPEC, run=f"run-{uuid.uuid4().hex[:8]}", rollouts=10, items=5)
    await seed_run(app_state(review.app).engine, spec)
    for r in range(10):
        await review.grade(f"seed_{spec.run}_{r:07d}", answer="x", score=0.25, run=spec.run, grader="judge")
    judge = await review.api("/review/api/curve", run=spec.run, grader="judge", axis="order", windows=2)
    assert [w["reward_mean"] for w in judge["windows"]] == [0.25, 0.25]
    seed = await review.api("/review/api/curve", run=spec.run, grader="seed", axis="order", windows=2)
    assert [w["reward_mean"] for w in seed["windows"]] == [0.4, 0.6]  # items 1, 4 always 1; 2 alternates
    empty = await review.api("/review/api/curve", run="no-such-run")
    assert empty["windows"] == []


async def test_the_run_page_draws_one_point_per_window(review: ReviewApp) -> None:
    spec = replace(SPEC, run=f"run-{uuid.uuid4().hex[:8]}")
    await seed_run(app_state(review.app).engine, spec)
    await login(review)
    for axis in ("time", "order"):
        curve = await review.api("/review/api/curve", run=spec.run, axis=axis, windows=20)
        page = (await review.client.get("/review/run", params={"name": spec.run, "axis": axis})).text
        chart = page[
            page.index('data-chart="reward-curve"') : page.index("</svg>", page.index("reward-curve"))
        ]
        assert chart.count('<circle class="point"') == len(curve["windows"]) > 10
        assert chart.count('<polygon class="band"') == 1
        assert 'data-chart="flags-curve"' in page and 'data-chart="calls-curve"' in page
