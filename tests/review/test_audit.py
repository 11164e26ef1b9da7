"""The run audit: synthetic runs with one known drift fire exactly that signal, a healthy run fires none;
the stored run read back through the API, the page and `sparring audit` (both backends)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.config import get_settings
from app.db.models import Grade, RolloutRow, ToolCall
from app.grading.recording import grade_row
from app.review.audit import AuditThresholds, audit_rows
from app.review.audit_repository import AuditRow
from tests.conftest import ADMIN_KEY
from tests.review.conftest import ADMIN, ReviewApp

ROLLOUTS = 40  # 5 windows of 8: each window holds 4 rollouts (a group) of 2 items


def item_of(i: int) -> str:
    return f"item-{i // 4}"


@dataclass(frozen=True)
class Shape:
    """How a synthetic rollout looks at position `i` of 40 (`late`: in the last window)."""

    score: float
    calls: int = 4
    tools: int = 2
    errors: int = 0
    answer: int = 100
    flagged: bool = False
    sub_scores: dict[str, float] = field(default_factory=dict)
    check: float | None = None  # another grader's score


def healthy(i: int) -> Shape:
    # Every group has rollouts that pass and fail, in every window; nothing drifts.
    score = 1.0 if i % 2 else 0.0
    return Shape(score=score, sub_scores={"correct": score, "format": score}, check=score)


def rising(i: int) -> float:
    """0 then 1 by window: the first window scores 0.25 on average, the last 0.875 (learning or hacking)."""
    window = i // 8
    return 1.0 if (i % 8) < [2, 3, 4, 6, 7][window] else 0.0


DRIFTS: dict[str, Any] = {
    "calls_fall": lambda i: replace(healthy(i), score=rising(i), calls=6 if i < 8 else 1, check=rising(i)),
    "distinct_tools_fall": lambda i: replace(
        healthy(i), score=rising(i), tools=4 if i < 8 else 1, check=rising(i)
    ),
    "answer_length": lambda i: replace(
        healthy(i), score=rising(i), answer=100 if i < 8 else 900, check=rising(i)
    ),
    "error_rate_rise": lambda i: replace(healthy(i), errors=0 if i < 32 else 2),
    "flagged_share_rise": lambda i: replace(healthy(i), flagged=i >= 32),
    "component_dominates": lambda i: replace(healthy(i), sub_scores={"correct": 0.05, "format": 1.0}),
    "variance_collapse": lambda i: replace(healthy(i), score=1.0, check=1.0) if i >= 32 else healthy(i),
    "unchecked_rise": lambda i: replace(healthy(i), score=rising(i), check=1.0 if i % 4 == 0 else 0.0),
}


def rows_of(shape: Any) -> tuple[list[AuditRow], dict[str, float]]:
    rows, check = [], {}
    for i in range(ROLLOUTS):
        x: Shape = shape(i)
        trace = f"t{i:03d}"
        rows.append(
            AuditRow(
                trace,
                item_of(i),
                x.calls,
                x.score,
                x.sub_scores,
                x.flagged,
                x.answer,
                x.tools,
                x.errors,
            )
        )
        if x.check is not None:
            check[trace] = x.check
    return rows, check


def test_a_healthy_run_fires_nothing() -> None:
    rows, check = rows_of(healthy)
    audit = audit_rows("r", None, rows, {"grader other": check}, AuditThresholds())
    assert audit.fired == [] and len(audit.signals) == 8 and audit.windows == 5
    assert all(s.evidence == [] for s in audit.signals)


@pytest.mark.parametrize("drift", sorted(DRIFTS))
def test_each_known_drift_fires_its_signal_only(drift: str) -> None:
    rows, check = rows_of(DRIFTS[drift])
    audit = audit_rows("r", None, rows, {"grader other": check}, AuditThresholds())
    assert audit.fired == [drift]
    signal = next(s for s in audit.signals if s.name == drift)
    last_window = {r.trace_id for r in rows[32:]}
    assert signal.evidence and set(signal.evidence) <= last_window, signal


def test_rollouts_without_an_item_are_no_group_of_one_item() -> None:
    # The drift that collapses the groups, but no rollout names its item: the audit cannot tell groups,
    # and must not read the whole run's spread as one item's.
    rows, check = rows_of(DRIFTS["variance_collapse"])
    unkeyed = [replace(r, item_key=None) for r in rows]
    audit = audit_rows("r", None, unkeyed, {"grader other": check}, AuditThresholds())
    assert audit.fired == []
    signal = next(s for s in audit.signals if s.name == "variance_collapse")
    assert signal.first is None and signal.last is None and signal.evidence == []


def test_thresholds_and_too_few_rollouts() -> None:
    rows, check = rows_of(DRIFTS["calls_fall"])
    lenient = AuditThresholds(drop=0.9)  # calls fall by 83%: under a 90% threshold nothing fires
    assert audit_rows("r", None, rows, {"grader other": check}, lenient).fired == []
    few = audit_rows("r", None, rows[:10], {}, AuditThresholds())
    assert few.fired == [] and few.signals == [] and "at least 20" in (few.note or "")


async def store_run(review: ReviewApp, run: str, shape: Any) -> list[str]:
    """The synthetic run in the database: rollouts in arrival order, their calls and their grades."""
    start = datetime(2026, 12, 1, tzinfo=UTC)
    traces = []
    async with review.sessions() as session, session.begin():
        for i in range(ROLLOUTS):
            x: Shape = shape(i)
            trace = f"trace_{run}_{i:03d}"
            traces.append(trace)
            seen = start + timedelta(minutes=i)
            session.add(
                RolloutRow(
                    trace_id=trace,
                    run=run,
                    item_key=f"id:{item_of(i)}",
                    first_seen=seen,
                    last_seen=seen,
                    graded_at=seen,
                    channel="rft",
                    calls=x.calls,
                )
            )
            for c in range(x.calls):
                session.add(
                    ToolCall(
                        trace_id=trace,
                        call_id=f"c{c}",
                        tool=f"tool{c % x.tools}",
                        arguments="{}",
                        output="Error: no" if c < x.errors else "ok",
                        outcome="model_error" if c < x.errors else "ok",
                        status_code=200,
                        started_at=seen,
                        ended_at=seen,
                        latency_ms=1.0,
                        worker="t",
                        run=run,
                    )
                )
            for grader, score, subs in (("main", x.score, x.sub_scores), ("other", x.check, {})):
                if score is None:
                    continue
                flags = (
                    [{"name": "repeated_call", "reason": "r", "evidence": []}]
                    if x.flagged and grader == "main"
                    else []
                )
                at = seen + timedelta(seconds=1 if grader == "main" else 0)  # "main" is the latest grade
                session.add(Grade(**grade_row(
                    flags=flags, trace_id=trace, grader=grader, grader_version="1", status="ok", score=score,
                    sub_scores=subs, errors=[], sample={"output_text": "a" * x.answer},
                    item={"id": item_of(i)}, run=run, latency_ms=1.0, created_at=at,
                )))  # fmt: skip
    return traces


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, backend_settings: dict[str, Any], tmp_path: Path) -> Any:
    monkeypatch.setenv("SPARRING_DATABASE_URL", backend_settings["database_url"])
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "cli-home"))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


async def test_a_stored_drifting_run_through_the_api_the_page_and_the_command(
    review: ReviewApp, cli_env: None
) -> None:
    bad, good = f"drift{uuid.uuid4().hex[:6]}", f"fine{uuid.uuid4().hex[:6]}"
    bad_traces = await store_run(review, bad, DRIFTS["calls_fall"])
    await store_run(review, good, healthy)
    audit = await review.api(f"/review/api/runs/{bad}/audit", grader="main")
    # One call a rollout is also one tool: both fire on the stored calls.
    assert audit["fired"] == ["calls_fall", "distinct_tools_fall"] and audit["rollouts"] == ROLLOUTS
    fired = next(s for s in audit["signals"] if s["name"] == "calls_fall")
    assert (fired["first"], fired["last"]) == (6.0, 1.0) and set(fired["evidence"]) <= set(bad_traces[32:])
    assert (await review.api(f"/review/api/runs/{good}/audit", grader="main"))["fired"] == []
    # Another grader hides nothing: the independent check is the other grader's scores.
    hacked = f"hack{uuid.uuid4().hex[:6]}"
    await store_run(review, hacked, DRIFTS["unchecked_rise"])
    assert (await review.api(f"/review/api/runs/{hacked}/audit", grader="main"))["fired"] == [
        "unchecked_rise"
    ]

    runner = CliRunner()
    loud = await asyncio.to_thread(runner.invoke, cli, ["audit", "--run", bad, "--grader", "main"])
    assert loud.exit_code == 1, loud.output
    assert "FIRED  calls_fall: tool calls per rollout 6.00 -> 1.00" in loud.output
    quiet = await asyncio.to_thread(runner.invoke, cli, ["audit", "--run", good, "--grader", "main"])
    assert quiet.exit_code == 0, quiet.output
    assert "FIRED" not in quiet.output and "quiet  unchecked_rise" in quiet.output

    await review.client.post("/review/login", data={"key": ADMIN_KEY, "next": "/review"})
    page = await review.client.get("/review/run", params={"name": bad, "grader": "main"})
    assert page.status_code == 200
    assert 'data-signal="calls_fall" data-fired="yes"' in page.text
    assert f"/review/rollouts/{fired['evidence'][0]}" in page.text
    own = await review.client.get(f"/review/runs/{good}/audit", params={"grader": "main"})
    assert own.status_code == 200 and 'data-fired="yes"' not in own.text and "no signal fired" in own.text
    assert (await review.client.get(f"/review/api/runs/{bad}/audit", headers=ADMIN)).status_code == 200
