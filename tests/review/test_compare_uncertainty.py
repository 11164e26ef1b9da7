"""Compare says how sure a change is: standard errors of the means, and a 95% interval of the change by
a bootstrap over items (rollouts of one item are not independent); coinciding items are counted."""

from __future__ import annotations

import re
import statistics
import uuid

import pytest

from app.review.uncertainty import ItemScores, bootstrap_difference, combined_error, standard_error
from tests.conftest import new_trace
from tests.review.conftest import ReviewApp
from tests.review.test_ui_auth import login


def test_the_standard_error_is_the_sample_std_over_root_n() -> None:
    scores = [0.0, 1.0, 1.0, 0.5, 0.25]
    population_std = statistics.pstdev(scores)
    assert standard_error(population_std, len(scores)) == pytest.approx(statistics.stdev(scores) / 5**0.5)
    assert standard_error(0.3, 1) is None and standard_error(None, 10) is None
    assert combined_error(0.3, 0.4) == pytest.approx(0.5) and combined_error(None, 0.4) is None


def test_the_interval_resamples_items_not_rollouts() -> None:
    # Two items of 100 rollouts each, one always 0 and one always 1, in both runs: a rollout-level
    # error would be tiny (0.05 a side), but with two items the run's mean could be anything.
    same = [ItemScores(100, 0.0), ItemScores(100, 100.0)]
    low, high = bootstrap_difference(same, same) or (0.0, 0.0)
    assert low <= -0.4 and high >= 0.4
    # A clear change over many items: the interval excludes 0 and holds the true change.
    a = [ItemScores(2, 0.0 if i % 4 else 2.0) for i in range(40)]  # mean 0.25
    b = [ItemScores(2, 2.0 if i % 4 else 0.0) for i in range(40)]  # mean 0.75
    low, high = bootstrap_difference(a, b) or (0.0, 0.0)
    assert 0 < low < 0.5 < high < 1
    assert bootstrap_difference(a, b) == (low, high)  # a fixed seed: the page shows one interval
    assert bootstrap_difference(a[:1], b) is None


async def _graded(review: ReviewApp, run: str, item: str, score: float) -> None:
    trace = new_trace()
    await review.call("echo", {"text": "x"}, trace, call_id="c1", run=run, item={"id": item})
    await review.grade(trace, answer="x", score=score, item={"id": item}, run=run)


async def test_compare_reports_errors_an_interval_and_counts_items_on_one_spot(review: ReviewApp) -> None:
    a, b = f"base-{uuid.uuid4().hex[:6]}", f"tuned-{uuid.uuid4().hex[:6]}"
    scores_a = {f"q{i}": [0.0, 0.0] for i in range(4)} | {"q4": [1.0, 0.0]}
    scores_b = {f"q{i}": [1.0, 1.0] for i in range(4)} | {"q4": [1.0, 0.0]}
    for run, scores in ((a, scores_a), (b, scores_b)):
        for item, values in scores.items():
            for value in values:
                await _graded(review, run, item, value)

    data = await review.api("/review/api/compare", a=a, b=b)
    flat_a = [v for values in scores_a.values() for v in values]
    flat_b = [v for values in scores_b.values() for v in values]
    se_a, se_b = statistics.stdev(flat_a) / 10**0.5, statistics.stdev(flat_b) / 10**0.5
    assert data["a"]["reward_se"] == pytest.approx(se_a) and data["b"]["reward_se"] == pytest.approx(se_b)
    assert data["reward_delta"] == pytest.approx(0.8)
    assert data["reward_delta_se"] == pytest.approx((se_a**2 + se_b**2) ** 0.5)
    low, high = data["reward_delta_ci"]
    assert 0 < low <= 0.8 <= high <= 1 and data["bootstrap_resamples"] > 0

    await login(review)
    page = (await review.client.get("/review/compare", params={"a": a, "b": b})).text
    assert f"± {se_a:.3g}" in page and 'id="reward-ci"' in page and "excludes 0" in page
    # q0..q3 all go 0 → 1: one dot for four items, with its count.
    assert re.search(r'<circle class="pair improved" data-items="4"', page)
    assert re.search(r'<text class="pair-count"[^>]*>4</text>', page)


async def test_the_standard_error_counts_only_scored_rollouts(review: ReviewApp) -> None:
    # A rollout whose latest grade failed has no score: it is not one of the means' values.
    a, b = f"base-{uuid.uuid4().hex[:6]}", f"tuned-{uuid.uuid4().hex[:6]}"
    scores = [0.0, 1.0, 1.0, 0.0, 0.5]
    for run in (a, b):
        for i, value in enumerate(scores):
            await _graded(review, run, f"q{i}", value)
        for i in range(5):
            trace = new_trace()
            await review.call("echo", {"text": "x"}, trace, call_id="c1", run=run, item={"id": f"f{i}"})
            await review.grade(trace, answer="x", score=None, status="failed", run=run)

    data = await review.api("/review/api/compare", a=a, b=b)
    assert data["a"]["graded"] == 10
    assert data["a"]["reward_se"] == pytest.approx(statistics.stdev(scores) / len(scores) ** 0.5)
