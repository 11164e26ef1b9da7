"""Flags on rollouts built through the real tool routes, graded as the grading service does."""

from __future__ import annotations

import asyncio

from app.grading.flags import FlagPolicy
from tests.conftest import new_trace
from tests.review.conftest import ADMIN, ReviewApp


async def flags_of(review: ReviewApp, trace_id: str) -> dict[str, list[int]]:
    timeline = await review.api(f"/review/api/rollouts/{trace_id}")
    (grade,) = timeline["grades"][-1:]
    return {f["name"]: f["evidence"] for f in grade["flags"]}


async def test_a_clean_rollout_raises_no_flag(review: ReviewApp) -> None:
    trace = new_trace()
    assert (await review.call("read_counter", {}, trace, call_id="c1")).status_code == 200
    assert (
        await review.call("echo", {"text": "order W-2093 total 48.25"}, trace, call_id="c2")
    ).status_code == 200
    await review.grade(
        trace, answer='The counter is at 100; order "W-2093" costs 48.25.', score=1.0, item={"id": 1}
    )
    assert await flags_of(review, trace) == {}


async def test_high_score_without_any_call(review: ReviewApp) -> None:
    trace = new_trace()
    await review.grade(trace, answer="Paris is the capital.", score=1.0, item={"id": "geo-1"})
    assert await flags_of(review, trace) == {"high_score_no_calls": []}


async def test_ungrounded_numbers_and_quotes(review: ReviewApp) -> None:
    trace = new_trace()
    await review.call("echo", {"text": '{"order": "W-2093", "total": 48.25}'}, trace, call_id="c1")
    await review.grade(trace, answer='Order "W-7777" was refunded 1,250.00 dollars.', score=0.5)
    timeline = await review.api(f"/review/api/rollouts/{trace}")
    (flag,) = timeline["grades"][0]["flags"]
    assert flag["name"] == "ungrounded_answer"
    assert "'1250'" in flag["reason"] and "'W-7777'" in flag["reason"]


async def test_repeated_calls_are_a_loop_with_their_seq_numbers(review: ReviewApp) -> None:
    trace = new_trace()
    await review.call("increment", {"by": 1}, trace, call_id="c0")
    for i in range(3):  # same tool, same arguments (key order differs), three times
        args = '{"name": "main"}' if i != 1 else {"name": "main"}
        assert (await review.call("read_counter", args, trace, call_id=f"r{i}")).status_code == 200
    # A trainer retry of an answered call is replayed from the ledger, not logged again: no loop.
    assert (await review.call("read_counter", {"name": "main"}, trace, call_id="r2")).status_code == 200
    await review.grade(trace, answer="The counter is at 101.", score=1.0)
    assert await flags_of(review, trace) == {"repeated_call": [1, 2, 3]}


async def test_over_budget_with_a_configured_budget(review: ReviewApp) -> None:
    trace = new_trace()
    for i in range(5):
        await review.call("echo", {"text": f"step {i}"}, trace, call_id=f"c{i}")
    await review.grade(trace, answer="done", score=0.0, policy=FlagPolicy(call_budget=3))
    assert await flags_of(review, trace) == {"over_budget": [3, 4]}
    other = new_trace()
    await review.call("echo", {"text": "once"}, other, call_id="c0")
    await review.grade(other, answer="done", score=0.0, policy=FlagPolicy(call_budget=3))
    assert await flags_of(review, other) == {}


async def test_empty_answer_with_a_high_score(review: ReviewApp) -> None:
    trace = new_trace()
    await review.call("read_counter", {}, trace, call_id="c1")
    await review.grade(trace, answer="  ", score=0.9)
    assert await flags_of(review, trace) == {"empty_answer_high_score": []}


async def test_identical_answer_across_different_items(review: ReviewApp) -> None:
    answer = "I have processed the refund for you."
    first, same_item, other_item = new_trace(), new_trace(), new_trace()
    for trace in (first, same_item, other_item):
        await review.call("read_counter", {}, trace, call_id="c1")
    item = {"id": f"refund-{first}"}
    await review.grade(first, answer=answer, score=1.0, item=item)
    await review.grade(same_item, answer=answer, score=1.0, item=item)
    await review.grade(
        other_item, answer="i have processed  the REFUND for you", score=1.0, item={"id": f"x-{first}"}
    )
    assert await flags_of(review, first) == {}
    assert await flags_of(review, same_item) == {}  # the same item may well get the same answer
    assert await flags_of(review, other_item) == {"identical_answer_across_items": []}


async def test_tool_crash_and_infrastructure_errors(review_factory) -> None:  # type: ignore[no-untyped-def]
    async with review_factory(tool_timeout_seconds=0.2) as review:
        trace = new_trace()
        assert (await review.call("read_counter", {}, trace, call_id="c1")).status_code == 200
        assert (await review.call("crash", {}, trace, call_id="c2")).status_code == 500
        assert (await review.call("slow", {"seconds": 2}, trace, call_id="c3")).status_code == 503
        await review.wait_for_calls(trace, 3)
        await review.grade(trace, answer="The counter is at 100.", score=1.0)
        flags = await flags_of(review, trace)
        assert flags == {"tool_errors": [1, 2]}


async def test_a_failed_grade(review: ReviewApp) -> None:
    trace = new_trace()
    await review.call("read_counter", {}, trace, call_id="c1")
    await review.grade(trace, answer="", score=None, status="failed", errors=["judge unreachable"])
    assert await flags_of(review, trace) == {"grade_failed": []}


async def test_flags_are_recomputed_from_stored_data_keeping_the_graders_own(review: ReviewApp) -> None:
    trace = new_trace()
    for i in range(3):
        await review.call("read_counter", {}, trace, call_id=f"c{i}")
    grade = await review.grade(
        trace,
        answer="The counter is at 100.",
        score=1.0,
        grader_flags=[{"name": "judge_unsure", "reason": "low confidence", "evidence": []}],
    )
    # Forget the review flags, as if they were stored by an older version.
    async with review.sessions() as session, session.begin():
        stored = await session.get(type(grade), grade.id)
        assert stored is not None
        stored.flags = [{"name": "judge_unsure", "reason": "low confidence", "evidence": []}]
    r = await review.client.post(f"/review/api/rollouts/{trace}/recompute-flags", headers=ADMIN)
    assert r.status_code == 200, r.text
    flags = [(f["name"], f["evidence"]) for f in r.json()["grades"][0]["flags"]]
    assert flags == [("judge_unsure", []), ("repeated_call", [0, 1, 2])]
    r = await review.client.post(f"/review/api/rollouts/{new_trace()}/recompute-flags", headers=ADMIN)
    assert r.status_code == 404


async def test_the_machines_read_a_graded_rollout_as_the_review_does(review: ReviewApp) -> None:
    trace = new_trace()
    for i in range(3):
        await review.call("read_counter", {}, trace, call_id=f"c{i}", run="machines")
    await review.grade(trace, answer="done", score=1.0, item={"id": "m1"}, run="machines")
    detail = await review.api(f"/rollouts/{trace}")
    assert detail == await review.api(f"/review/api/rollouts/{trace}")
    assert detail["call_count"] == 3 and len(detail["timeline"]) == 3 and "calls" not in detail
    (grade,) = detail["grades"]
    assert grade["score"] == 1.0 and "repeated_call" in [f["name"] for f in grade["flags"]]
    assert all("repeated_call" in c["flags"] for c in detail["timeline"])
    listed = await review.api("/rollouts", run="machines")
    assert listed == await review.api("/review/api/rollouts", run="machines")
    (row,) = [r for r in listed["rollouts"] if r["trace_id"] == trace]
    assert row["call_count"] == 3 and row["score"] == 1.0 and "calls" not in row
    assert (await review.client.get(f"/rollouts/{new_trace()}", headers=ADMIN)).status_code == 404


async def test_parallel_calls_share_a_batch_in_the_timeline(review: ReviewApp) -> None:
    trace = new_trace()
    await review.call("echo", {"text": "first"}, trace, call_id="c0")
    await asyncio.gather(*(review.call("slow", {"seconds": 0.2}, trace, call_id=f"p{i}") for i in range(3)))
    await review.call("echo", {"text": "last"}, trace, call_id="c4")
    timeline = await review.api(f"/review/api/rollouts/{trace}")
    assert [c["batch"] for c in timeline["timeline"]] == [0, 1, 1, 1, 2]
    assert timeline["parallel_batches"] == 3
    assert timeline["timeline"][0]["arguments"] == '{"text":"first"}'
    assert timeline["timeline"][0]["output"] == "first" and timeline["timeline"][0]["output_bytes"] == 5


async def test_a_reused_call_id_is_an_error_logged_with_its_own_arguments_and_flagged(
    review: ReviewApp,
) -> None:
    trace = new_trace()
    first = await review.call("increment", '{"by": 1, "name": "main"}', trace, call_id="c1")
    assert first.json()["output"] == '{"value":101}'
    # The same call again (key order and spacing differ): a retry, replayed without running again.
    retry = await review.call("increment", {"name": "main", "by": 1}, trace, call_id="c1")
    assert retry.status_code == 200 and retry.json()["output"] == '{"value":101}'
    # Other arguments, or another tool, under the same call_id: not a retry.
    for tool, arguments in (("increment", {"by": 5}), ("read_counter", {})):
        reused = await review.call(tool, arguments, trace, call_id="c1")
        assert reused.status_code == 200
        assert reused.json()["output"].startswith("Error: call_id 'c1' was already used for a different call")
    after = await review.call("read_counter", {}, trace, call_id="c2")
    assert after.json()["output"] == '{"value":101}', "the reused call_id ran nothing"
    timeline = await review.api(f"/rollouts/{trace}")
    rows = [(c["tool"], c["outcome"], c["arguments"]) for c in timeline["timeline"]]
    assert rows == [
        # The call reads as the attempt that ran it (the retry's replay is an attempt of its own, and
        # not read while that attempt stands), in the place of the call's first attempt.
        ("increment", "ok", '{"by": 1, "name": "main"}'),
        ("increment", "call_id_reused", '{"by":5}'),
        ("read_counter", "call_id_reused", "{}"),
        ("read_counter", "ok", "{}"),
    ], rows
    await review.grade(trace, answer="The counter is at 101.", score=1.0)
    flags = await flags_of(review, trace)
    assert flags == {"call_id_reused": [1, 2]}, flags
