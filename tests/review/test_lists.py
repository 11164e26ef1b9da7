"""The rollout list: search, totals, every sort keyset-paginated, graders named; one flag per name."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from app.db.models import RolloutRow
from app.deps import app_state
from app.review.seed import SeedSpec, generate, seed_run
from tests.conftest import new_trace
from tests.review.conftest import ADMIN, ReviewApp

SPEC = SeedSpec(rollouts=45, items=5, min_calls=0, max_calls=9)


async def seeded(review: ReviewApp, **overrides: Any) -> SeedSpec:
    spec = replace(SPEC, run=f"run-{uuid.uuid4().hex[:8]}", **overrides)
    await seed_run(app_state(review.app).engine, spec)
    return spec


async def every_page(review: ReviewApp, **params: Any) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cursor = None
    for _ in range(50):
        page = await review.api("/review/api/rollouts", limit=7, cursor=cursor, **params)
        rows += page["rollouts"]
        cursor = page["next_cursor"]
        if cursor is None:
            return rows
    raise AssertionError("pagination did not end")


@pytest.mark.parametrize("sort", ["time", "score", "calls", "duration"])
@pytest.mark.parametrize("order", ["desc", "asc"])
async def test_every_sort_pages_through_every_rollout_once_in_order(
    review: ReviewApp, sort: str, order: str
) -> None:
    spec = await seeded(review)
    rollouts, _, grades = generate(spec)
    rows = await every_page(review, run=spec.run, sort=sort, order=order)
    ids = [r["trace_id"] for r in rows]
    assert len(ids) == len(set(ids)) == spec.rollouts

    score = {g["trace_id"]: g["score"] for g in grades}
    duration = {r["trace_id"]: (r["last_seen"] - r["first_seen"]).total_seconds() for r in rollouts}
    calls = {r["trace_id"]: r["calls"] for r in rollouts}
    last_seen = {r["trace_id"]: r["last_seen"] for r in rollouts}
    key = {"time": last_seen, "score": score, "calls": calls, "duration": duration}[sort]
    expected = sorted(ids, key=lambda t: (key[t], t), reverse=order == "desc")
    if sort == "duration":  # the database's float arithmetic may order near-equal durations either way
        assert [round(key[t], 3) for t in ids] == [round(key[t], 3) for t in expected]
    else:
        assert ids == expected


async def test_a_cursor_of_another_sort_is_refused(review: ReviewApp) -> None:
    spec = await seeded(review)
    page = await review.api("/review/api/rollouts", run=spec.run, limit=5, sort="score")
    response = await review.client.get(
        "/review/api/rollouts",
        params={"run": spec.run, "cursor": page["next_cursor"], "sort": "calls"},
        headers=ADMIN,
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "bad_request"


async def test_search_finds_trace_ids_items_and_answer_text(review: ReviewApp) -> None:
    spec = await seeded(review)
    other = await seeded(review)

    async def found(q: str, **params: Any) -> set[str]:
        page = await review.api("/review/api/rollouts", q=q, limit=500, count="true", **params)
        assert page["total"] == len(page["rollouts"])
        return {r["trace_id"] for r in page["rollouts"]}

    # A fragment of the trace id.
    assert await found(f"{spec.run}_0000012") == {f"seed_{spec.run}_0000012"}
    # An item by its id alone (the stored key is "id:item-00003"), and as a search fragment.
    by_item = {f"seed_{spec.run}_{r:07d}" for r in range(3, 45, 5)}
    assert await found("item-00003", run=spec.run) == by_item
    page = await review.api("/review/api/rollouts", run=spec.run, item="item-00003", limit=500)
    assert {r["trace_id"] for r in page["rollouts"]} == by_item
    # Answer text: "The answer for item 4 is 4-2." is graded on repetitions 2, 5, 8 of item 4.
    assert await found("IS 4-2.", run=spec.run) == {f"seed_{spec.run}_{r:07d}" for r in (14, 29, 44)}
    # Wildcards are text, not patterns.
    assert await found("%", run=spec.run) == set()
    assert await found("_", run=other.run) == {f"seed_{other.run}_{r:07d}" for r in range(45)}


async def test_search_reads_the_last_message_when_there_is_no_output_text(review: ReviewApp) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    trace = new_trace()
    await review.call("echo", {"text": "hi"}, trace, call_id="c1", run=run)
    await review.grade(trace, answer="", score=0.5, run=run)
    async with review.sessions() as session, session.begin():
        from sqlalchemy import update

        from app.db.models import Grade

        sample = {"choices": [{"message": {"role": "assistant", "content": "Parcel 88 is lost"}}]}
        await session.execute(update(Grade).where(Grade.trace_id == trace).values(sample=sample))
    page = await review.api("/review/api/rollouts", q="parcel 88", count="true")
    assert [r["trace_id"] for r in page["rollouts"]] == [trace] and page["total"] == 1


async def test_search_ignores_the_case_of_every_letter_on_both_backends(review: ReviewApp) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    trace = new_trace()
    await review.call("echo", {"text": "hi"}, trace, call_id="c1", run=run, item={"id": "Çà-7"})
    await review.grade(trace, answer="Zurück zur ÉCOLE", score=0.5, run=run, item={"id": "Çà-7"})
    for q in ("école", "ZURÜCK", "çà-7", "ÉCOLE"):
        page = await review.api("/review/api/rollouts", run=run, q=q, count="true")
        assert [r["trace_id"] for r in page["rollouts"]] == [trace] and page["total"] == 1, q


async def test_the_item_filter_tells_items_apart_by_case_on_both_backends(review: ReviewApp) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    traces = {}
    for key in ("Abc", "abc"):
        traces[key] = trace = new_trace()
        await review.call("echo", {"text": "x"}, trace, call_id="c1", run=run, item={"id": key})
        await review.grade(trace, answer="x", score=1.0, run=run, item={"id": key})
    for item, expected in (("Abc", {traces["Abc"]}), ("id:abc", {traces["abc"]}), ("ABC", set())):
        page = await review.api("/review/api/rollouts", run=run, item=item)
        assert {r["trace_id"] for r in page["rollouts"]} == expected, item


async def add_spans(review: ReviewApp, run: str, spans: dict[str, tuple[int, int]]) -> None:
    """Rollouts of `run` without calls, each first and last seen at these microseconds past a second."""
    start = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
    async with review.sessions() as session, session.begin():
        for trace, (first, last) in spans.items():
            session.add(
                RolloutRow(
                    trace_id=trace,
                    run=run,
                    first_seen=start + timedelta(microseconds=first),
                    last_seen=start + timedelta(microseconds=last),
                    calls=0,
                )
            )


async def test_duration_sorts_by_the_microsecond_on_both_backends(review: ReviewApp) -> None:
    # 1.4 ms beats 0.8 ms: both a millisecond to SQLite's julianday(), which keeps milliseconds only.
    run = f"run-{uuid.uuid4().hex[:8]}"
    spans = {f"{run}-a": (0, 1400), f"{run}-b": (400, 1200), f"{run}-c": (0, 300)}
    await add_spans(review, run, spans)
    page = await review.api("/review/api/rollouts", run=run, sort="duration")
    assert [r["trace_id"] for r in page["rollouts"]] == [f"{run}-a", f"{run}-b", f"{run}-c"]


async def test_the_duration_of_a_rollout_starting_in_a_seconds_last_half_ms(review: ReviewApp) -> None:
    # SQLite's strftime('%s') rounds 12:00:00.9996 up to the next second: the fraction is added to the
    # whole seconds written, not to that rounded second (1.4 ms read as -998.6 ms, sorted last).
    run = f"run-{uuid.uuid4().hex[:8]}"
    spans = {f"{run}-late": (999_600, 1_001_000), f"{run}-early": (0, 800)}
    await add_spans(review, run, spans)
    page = await review.api("/review/api/rollouts", run=run, sort="duration")
    assert [r["trace_id"] for r in page["rollouts"]] == [f"{run}-late", f"{run}-early"]


async def test_totals_count_every_match_across_pages(review: ReviewApp) -> None:
    spec = await seeded(review)
    page = await review.api("/review/api/rollouts", run=spec.run, min_score=0.5, limit=4, count="true")
    _, _, grades = generate(spec)
    assert page["total"] == sum(g["score"] >= 0.5 for g in grades) and len(page["rollouts"]) == 4
    assert (await review.api("/review/api/rollouts", run=spec.run))["total"] is None  # not asked


async def test_graders_are_listed_and_select_the_grade_counted(review: ReviewApp) -> None:
    spec = await seeded(review, rollouts=10, items=5)
    trace = f"seed_{spec.run}_0000001"
    await review.grade(trace, answer="late", score=0.25, run=spec.run, grader="judge")
    graders = await review.api("/review/api/graders", run=spec.run)
    assert graders == [{"grader": "seed", "rollouts": 10}, {"grader": "judge", "rollouts": 1}]
    latest = await review.api("/review/api/rollouts", run=spec.run, q="_0000001")
    assert [(r["grader"], r["score"]) for r in latest["rollouts"]] == [("judge", 0.25)]
    seed = await review.api("/review/api/rollouts", run=spec.run, q="_0000001", grader="seed")
    assert [(r["grader"], r["score"]) for r in seed["rollouts"]] == [("seed", 1.0)]


async def test_a_flag_raised_twice_on_one_grade_is_shown_once(review: ReviewApp) -> None:
    trace = new_trace()
    await review.call("echo", {"text": "total 12"}, trace, call_id="c1")
    grader_flag = {"name": "ungrounded_answer", "reason": "the answer states '4711'", "evidence": []}
    await review.grade(trace, answer="The total is 4711.", score=1.0, grader_flags=[grader_flag])
    timeline = await review.api(f"/review/api/rollouts/{trace}")
    names = [f["name"] for f in timeline["grades"][0]["flags"]]
    assert names.count("ungrounded_answer") == 1, names
    listed = await review.api("/review/api/rollouts", q=trace)
    assert listed["rollouts"][0]["flags"].count("ungrounded_answer") == 1
