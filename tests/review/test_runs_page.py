"""The runs page: per run its mean reward, grader, model and a reward line; a canary's runs grouped."""

from __future__ import annotations

import re
import uuid

from tests.conftest import GRADER_KEY, new_trace
from tests.review.conftest import ReviewApp
from tests.review.test_ui_auth import login

GRADER = {"Authorization": f"Bearer {GRADER_KEY}"}


async def rollout(review: ReviewApp, run: str | None, score: float | None, model: str | None = None) -> str:
    trace = new_trace()
    await review.call("echo", {"text": "x"}, trace, call_id="c1", run=run)
    if score is not None:
        await review.grade(trace, answer="x", score=score, run=run)
    if model is not None:
        conversation = {"model": model, "messages": [{"role": "user", "content": "go"}]}
        stored = await review.client.put(f"/rollouts/{trace}/transcript", json=conversation, headers=GRADER)
        assert stored.status_code == 200
    return trace


def row_of(page: str, run: str) -> str:
    match = re.search(rf'<tr class="run-row[^"]*" data-run="{re.escape(run)}">(.*?)</tr>', page, re.S)
    assert match, run
    return match.group(1)


async def test_runs_show_reward_grader_model_and_a_line(review: ReviewApp) -> None:
    run = f"train-{uuid.uuid4().hex[:6]}"
    for score in (0.0, 0.0, 1.0, 1.0):
        await rollout(review, run, score, model="policy-7b")
    await rollout(review, run, None)  # not graded: counted, not scored
    await rollout(review, None, None)
    await login(review)
    page = (await review.client.get("/review/runs")).text

    row = row_of(page, run)
    assert re.search(r'class="num reward-mean">0\.5<span class="muted scored"> · 4 scored', row)
    assert '<td class="grader">test' in row and "policy-7b" in row
    line = re.search(r'<polyline points="([^"]+)"', row)
    assert line, row
    heights = [float(point.split(",")[1]) for point in line.group(1).split()]
    assert heights[0] > heights[-1]  # reward rose: the line goes up (SVG y grows downwards)
    assert "(no label)" in page


async def test_a_canary_s_runs_are_grouped_under_its_label(review: ReviewApp) -> None:
    label = f"canary-{uuid.uuid4().hex[:6]}"
    await rollout(review, f"{label}-empty", 0.0, model="canary:empty")
    await rollout(review, f"{label}-gold", 1.0, model="canary:gold")
    lookalike = f"my-{uuid.uuid4().hex[:4]}-gold"  # ends like a canary, but a model ran it
    await rollout(review, lookalike, 1.0, model="policy-7b")
    await login(review)
    page = (await review.client.get("/review/runs")).text

    group = page.index(f'data-canary="{label}"')
    members = [page.index(f'data-run="{label}-{policy}"') for policy in ("empty", "gold")]
    assert all(index > group for index in members) and page.count(f'data-canary="{label}"') == 1
    assert f'<tr class="run-row canary-member" data-run="{label}-empty">' in page
    assert 'data-canary="my-' not in page and f'<tr class="run-row" data-run="{lookalike}">' in page


async def test_the_rollout_list_colours_scores_and_draws_them_as_bars(review: ReviewApp) -> None:
    run = f"bars-{uuid.uuid4().hex[:6]}"
    low, high = await rollout(review, run, 0.1), await rollout(review, run, 0.9)
    await login(review)
    page = (await review.client.get("/review", params={"run": run})).text
    for trace, band, width in ((low, "score-low", "5.6"), (high, "score-high", "50.4")):
        row = page[page.index(f'data-trace="{trace}"') :]
        row = row[: row.index("</tr>")]
        assert f'class="score-value {band}"' in row
        assert f'<rect class="fill" width="{width}"' in row
    assert '<div class="table-scroll">' in page
