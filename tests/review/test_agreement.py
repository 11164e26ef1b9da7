"""Agreement of graders with each other and with labels: the figures against a hand computation, the API,
the page with its scatter, and `sparring graders agreement`."""

from __future__ import annotations

import asyncio
import math
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.config import get_settings
from app.db.models import Grade
from app.grading.recording import grade_row
from app.review.agreement import MAX_DISAGREEMENTS, cohen_kappa, precision_recall, spearman
from tests.conftest import ADMIN_KEY, new_trace
from tests.review.conftest import ADMIN, ReviewApp

# The example, by hand: retail passes the first 4 of 8 rollouts, nonempty passes all 8, and
# people passed the first 5.
#   retail vs nonempty: agreement 4/8; chance 0.5*1 + 0.5*0 = 0.5, kappa (0.5-0.5)/0.5 = 0; nonempty is
#   constant, so Spearman is undefined.
#   retail vs labels: 7/8 agree; chance 0.5*0.625 + 0.5*0.375 = 0.5, kappa (0.875-0.5)/0.5 = 0.75;
#   precision 4/4, recall 4/5. nonempty vs labels: 5/8 agree; chance 1*0.625 = 0.625, kappa 0;
#   precision 5/8, recall 5/5.
RETAIL = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
LABELS = ["pass"] * 5 + ["fail"] * 3


def test_kappa_precision_recall_spearman_by_hand() -> None:
    retail = [s >= 0.5 for s in RETAIL]
    truth = [label == "pass" for label in LABELS]
    assert cohen_kappa(retail, truth) == pytest.approx(0.75)
    assert cohen_kappa(retail, [True] * 8) == pytest.approx(0.0)
    assert precision_recall(retail, truth) == (1.0, 0.8)
    assert precision_recall([False] * 8, truth) == (None, 0.0)  # no predicted pass: precision undefined
    assert cohen_kappa([True, True], [True, True]) is None  # chance agreement is already total
    assert cohen_kappa([], []) is None
    # Ties share their mean rank: b's ranks are 1, 2, 3.5, 5, 3.5; cov 8, variances 10 and 9.5.
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 1, 1]) is None and spearman([1], [2]) is None


async def labelled_run(review: ReviewApp) -> tuple[str, list[str]]:
    run = f"agree-{uuid.uuid4().hex[:8]}"
    traces = [new_trace() for _ in RETAIL]
    for i, (trace, score, label) in enumerate(zip(traces, RETAIL, LABELS, strict=True)):
        await review.call("echo", {"text": "hi"}, trace, call_id="c1", run=run)
        item = {"id": f"item-{i}"}
        await review.grade(trace, answer="a", score=score, item=item, run=run, grader="retail")
        await review.grade(trace, answer="a", score=1.0, item=item, run=run, grader="nonempty")
        response = await review.client.put(
            f"/review/api/rollouts/{trace}/label", json={"label": label}, headers=ADMIN
        )
        assert response.status_code == 200
    # An older grade of retail that the latest replaces: only the latest counts.
    await review.grade(traces[0], answer="a", score=1.0, item={"id": "item-0"}, run=run, grader="old")
    return run, traces


async def test_the_agreement_api_matches_the_hand_computation(review: ReviewApp) -> None:
    run, traces = await labelled_run(review)
    # A later failed grade of nonempty on one rollout: no score, so that rollout leaves the pair.
    await review.grade(traces[7], answer="a", score=None, status="failed", run=run, grader="nonempty")
    figures = await review.api(f"/review/api/runs/{run}/agreement")
    pairs = {(p["a"], p["b"]): p for p in figures["pairs"]}
    assert figures["run"] == run and figures["threshold"] == 0.5
    assert pairs[("nonempty", "retail")] == {
        "a": "nonempty",
        "b": "retail",
        "n": 7,
        "agreement": pytest.approx(4 / 7),
        "kappa": 0.0,
        "spearman": None,
        "disagreed": 3,
        "disagreements": sorted(traces[4:7]),
    }
    assert pairs[("old", "retail")]["n"] == 1 and pairs[("old", "retail")]["kappa"] is None
    labels = {g["grader"]: g for g in figures["labels"]}
    assert labels["retail"] == {
        "grader": "retail",
        "n": 8,
        "agreement": 0.875,
        "kappa": 0.75,
        "precision": 1.0,
        "recall": 0.8,
        "disagreed": 1,
        "disagreements": [traces[4]],
    }
    assert (labels["nonempty"]["n"], labels["nonempty"]["precision"], labels["nonempty"]["recall"]) == (
        7,
        pytest.approx(5 / 7),
        1.0,
    )
    # A threshold above every score: nobody passes, retail agrees with the 3 fails only.
    strict = await review.api(f"/review/api/runs/{run}/agreement", threshold=2)
    retail = next(g for g in strict["labels"] if g["grader"] == "retail")
    assert (retail["agreement"], retail["precision"], retail["recall"]) == (0.375, None, 0.0)
    assert (await review.client.get(f"/review/api/runs/{run}/agreement")).status_code == 401
    empty = await review.api(f"/review/api/runs/no/such-{run}/agreement")  # a label may hold a slash
    assert empty == {"run": f"no/such-{run}", "threshold": 0.5, "pairs": [], "labels": []}


async def test_the_graders_page_draws_the_scatter(review: ReviewApp) -> None:
    run, traces = await labelled_run(review)
    await review.client.post("/review/login", data={"key": ADMIN_KEY, "next": "/review"})
    page = await review.client.get(f"/review/runs/{run}/graders", params={"a": "nonempty", "b": "retail"})
    assert page.status_code == 200
    # One dot per distinct pair of scores (rollouts on the same spot share a dot with its count).
    assert 'data-chart="graders"' in page.text and 0 < page.text.count('class="pair ') <= 8
    assert 'data-pair="nonempty|retail"' in page.text and 'data-grader="retail"' in page.text
    assert f"/review/rollouts/{traces[4]}" in page.text  # a disagreement to open
    bad = await review.client.get(f"/review/runs/{run}/graders", params={"threshold": "x"})
    assert bad.status_code == 200 and "threshold must be a number" in bad.text


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, backend_settings: dict[str, Any], tmp_path: Path) -> Any:
    monkeypatch.setenv("SPARRING_DATABASE_URL", backend_settings["database_url"])
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "cli-home"))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


async def test_the_command_prints_what_the_api_answers(review: ReviewApp, cli_env: None) -> None:
    run, traces = await labelled_run(review)
    api = await review.api(f"/review/api/runs/{run}/agreement")
    runner = CliRunner()
    printed = await asyncio.to_thread(runner.invoke, cli, ["graders", "agreement", "--run", run, "--json"])
    assert printed.exit_code == 0, printed.output
    assert orjson.loads(printed.output) == api
    table = await asyncio.to_thread(runner.invoke, cli, ["graders", "agreement", "--run", run])
    assert table.exit_code == 0, table.output
    assert "  retail  8  0.875  0.750  1.000  0.800  1  " + traces[4] in table.output


async def test_disagreements_are_counted_past_the_listed_ones(review: ReviewApp, cli_env: None) -> None:
    # More disagreements than the figures list: the count shown is over every rollout.
    run = f"many-{uuid.uuid4().hex[:8]}"
    disagreeing = MAX_DISAGREEMENTS + 100
    now = datetime.now(UTC)
    async with review.sessions() as session, session.begin():
        for i in range(disagreeing):
            for grader, score in (("strict", 0.0), ("loose", 1.0)):
                fields: Any = {"trace_id": f"trace_many_{i:05d}", "grader": grader, "grader_version": "1"}
                fields |= {"status": "ok", "score": score, "sub_scores": {}, "errors": []}
                fields |= {"sample": {"output_text": "a"}, "item": {"id": i}, "run": run}
                session.add(Grade(**grade_row(flags=[], latency_ms=1.0, created_at=now, **fields)))
    [pair] = (await review.api(f"/review/api/runs/{run}/agreement"))["pairs"]
    assert (pair["n"], pair["agreement"], len(pair["disagreements"])) == (disagreeing, 0.0, MAX_DISAGREEMENTS)
    assert pair["disagreed"] == disagreeing
    await review.client.post("/review/login", data={"key": ADMIN_KEY, "next": "/review"})
    page = (await review.client.get(f"/review/runs/{run}/graders")).text
    assert f"<td>{disagreeing}: " in page and f"and {disagreeing - 20} more" in page
    table = await asyncio.to_thread(CliRunner().invoke, cli, ["graders", "agreement", "--run", run])
    assert f"  loose  strict  {disagreeing}  0.000  " in table.output
    assert f"  -  {disagreeing}  trace_many_00000 " in table.output
