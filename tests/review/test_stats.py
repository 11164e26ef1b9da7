"""Run and item statistics on generated runs with known answers; filters, pages, comparison."""

from __future__ import annotations

import math
import re
import uuid
from collections import Counter
from dataclasses import replace

import pytest
from sqlalchemy import update

from app.db.models import Grade
from app.deps import app_state
from app.review.seed import SeedSpec, generate, seed_run
from tests.conftest import new_trace
from tests.review.conftest import ADMIN, TOOLS, ReviewApp

SPEC = SeedSpec(rollouts=60, items=6, min_calls=0, max_calls=9, crash_share=0.02)


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


async def seeded(review: ReviewApp, spec: SeedSpec = SPEC) -> SeedSpec:
    spec = replace(spec, run=f"run-{uuid.uuid4().hex[:8]}")
    result = await seed_run(app_state(review.app).engine, spec)
    assert result.rollouts == spec.rollouts
    assert (result.items_always_zero, result.items_always_one, result.items_mixed) == (2, 2, 2)
    return spec


async def test_run_statistics_match_the_generated_data(review: ReviewApp) -> None:
    spec = await seeded(review)
    _, calls, grades = generate(spec)
    stats = await review.api("/review/api/stats", run=spec.run)

    assert stats["rollouts"] == 60
    # Items 0, 3 always score 0, items 1, 4 always 1, items 2, 5 alternate: the mean reward is 0.5.
    reward = stats["reward"]
    assert (reward["graded"], reward["scored"], reward["failed"]) == (60, 60, 0)
    assert reward["mean"] == pytest.approx(0.5) and reward["std"] == pytest.approx(0.5)
    assert reward["histogram"]["counts"] == [30, 0, 0, 0, 0, 0, 0, 0, 0, 30]
    assert reward["histogram"]["edges"][0] == 0 and reward["histogram"]["edges"][-1] == 1

    per_rollout = Counter(c["trace_id"] for c in calls)
    expected = Counter(per_rollout.get(f"seed_{spec.run}_{r:07d}", 0) for r in range(60))
    distribution = stats["calls_per_rollout"]
    assert dict(zip(distribution["values"], distribution["counts"], strict=True)) == dict(expected)
    assert stats["calls_per_rollout_histogram"]["counts"] == [
        expected.get(n, 0) for n in range(max(expected) + 1)
    ]
    assert stats["platform"]["tool_calls_per_rollout"] == pytest.approx(len(calls) / 60)

    by_tool = {t["tool"]: t for t in stats["tools"]}
    assert set(by_tool) == {c["tool"] for c in calls}
    for tool, row in by_tool.items():
        mine = [c for c in calls if c["tool"] == tool]
        latencies = [c["latency_ms"] for c in mine]
        assert row["calls"] == len(mine)
        assert row["latency_p50_ms"] == pytest.approx(nearest_rank(latencies, 0.5))
        assert row["latency_p90_ms"] == pytest.approx(nearest_rank(latencies, 0.9))
        assert row["latency_p99_ms"] == pytest.approx(nearest_rank(latencies, 0.99))
        assert row["outcomes"] == {o: sum(c["outcome"] == o for c in mine) for o in row["outcomes"]}
        assert row["output_bytes_mean"] == pytest.approx(
            sum(len((c["output"] or "").encode()) for c in mine) / len(mine)
        )
    all_latencies = [c["latency_ms"] for c in calls]
    assert stats["platform"]["tool_latency"]["p50_ms"] == pytest.approx(nearest_rank(all_latencies, 0.5))
    outcomes = Counter(c["outcome"] for c in calls)
    assert stats["errors_by_outcome"] == {
        o: outcomes.get(o, 0) for o in ("ok", "model_error", "tool_crash", "infra_error", "call_id_reused")
    }
    assert stats["platform"]["tool_errors"] == outcomes.get("tool_crash", 0)
    assert stats["platform"]["model_errors"] == outcomes.get("model_error", 0)

    items = stats["items"]
    assert (items["items"], items["repeated_items"], items["always_zero"], items["always_one"]) == (
        6,
        6,
        2,
        2,
    )
    assert items["share_no_signal"] == pytest.approx(4 / 6)

    flagged = Counter(f["name"] for g in grades for f in g["flags"])
    assert {f["name"]: f["rollouts"] for f in stats["flags"]} == dict(flagged)


async def test_item_statistics(review: ReviewApp) -> None:
    spec = await seeded(review)
    page = await review.api("/review/api/items", run=spec.run, order="mean")
    items = {i["item_key"]: i for i in page["items"]}
    assert len(items) == 6 and page["next_offset"] is None
    for index in range(6):
        item = items[f"id:item-{index:05d}"]
        assert item["rollouts"] == 10
        kind = ("zero", "one", "mixed")[index % 3]
        assert item["mean"] == pytest.approx({"zero": 0.0, "one": 1.0, "mixed": 0.5}[kind])
        assert item["variance"] == pytest.approx({"zero": 0.0, "one": 0.0, "mixed": 0.25}[kind])
        assert (item["always_zero"], item["always_one"]) == (kind == "zero", kind == "one")
    assert [i["mean"] for i in page["items"]] == sorted(i["mean"] for i in page["items"])
    by_variance = await review.api("/review/api/items", run=spec.run, order="variance", limit=2)
    assert [i["variance"] for i in by_variance["items"]] == pytest.approx([0.25, 0.25])
    assert by_variance["next_offset"] == 2


async def test_items_sort_the_same_on_both_backends_rollouts_without_an_item_last(review: ReviewApp) -> None:
    run = f"items-{uuid.uuid4().hex[:8]}"
    for item in ({"id": "b"}, None, {"id": "a"}, None):
        trace = new_trace()
        await review.call("echo", {"text": "x"}, trace, call_id="c1", run=run, item=item)
        await review.grade(trace, answer="x", score=0.5, item=item, run=run)
    for order in ("item", "mean", "variance", "rollouts"):
        page = await review.api("/review/api/items", run=run, order=order)
        keys = [i["item_key"] for i in page["items"]]
        expected = ["id:a", "id:b", None] if order != "rollouts" else [None, "id:a", "id:b"]
        assert keys == expected, order


async def test_rollouts_without_an_item_are_not_an_item_of_the_summary(review: ReviewApp) -> None:
    # Three unkeyed rollouts scoring 1 are not an item "always 1": only item a counts, and it varies.
    run = f"items-{uuid.uuid4().hex[:8]}"
    for item, score in ((None, 1.0), (None, 1.0), (None, 1.0), ({"id": "a"}, 0.0), ({"id": "a"}, 1.0)):
        trace = new_trace()
        await review.call("echo", {"text": "x"}, trace, call_id="c1", run=run, item=item)
        await review.grade(trace, answer="x", score=score, item=item, run=run)
    summary = (await review.api("/review/api/stats", run=run))["items"]
    assert (summary["items"], summary["repeated_items"], summary["always_one"]) == (1, 1, 0)
    assert summary["share_no_signal"] == 0.0
    page = await review.api("/review/api/items", run=run)
    assert page["summary"] == summary


async def test_rollout_filters_and_pagination(review: ReviewApp) -> None:
    spec = await seeded(review)
    first = await review.api("/review/api/rollouts", run=spec.run, limit=25)
    assert len(first["rollouts"]) == 25 and first["next_cursor"]
    second = await review.api("/review/api/rollouts", run=spec.run, limit=25, cursor=first["next_cursor"])
    third = await review.api("/review/api/rollouts", run=spec.run, limit=25, cursor=second["next_cursor"])
    seen = [r["trace_id"] for page in (first, second, third) for r in page["rollouts"]]
    assert len(seen) == len(set(seen)) == 60 and third["next_cursor"] is None
    last_seen = [r["last_seen"] for page in (first, second, third) for r in page["rollouts"]]
    assert last_seen == sorted(last_seen, reverse=True)

    async def count(**params: object) -> int:
        page = await review.api("/review/api/rollouts", run=spec.run, limit=500, **params)
        return len(page["rollouts"])

    assert await count(min_score=0.9) == 30 and await count(max_score=0.1) == 30
    assert await count(item="id:item-00002") == 10
    assert await count(item="id:item-00002", min_score=1) == 5
    _, calls, grades = generate(spec)
    with_search = {c["trace_id"] for c in calls if c["tool"] == "search"}
    assert await count(tool="search") == len(with_search)
    repeated = {g["trace_id"] for g in grades if any(f["name"] == "repeated_call" for f in g["flags"])}
    assert repeated, "the seed should produce some loops"
    page = await review.api("/review/api/rollouts", run=spec.run, flag="repeated_call", limit=500)
    assert {r["trace_id"] for r in page["rollouts"]} == repeated
    assert all("repeated_call" in r["flags"] for r in page["rollouts"])
    assert await count(since=spec.start.replace(minute=2).isoformat()) == 20  # rollouts start 3 s apart
    assert await count(until=spec.start.replace(minute=1).isoformat()) == 20
    assert await count(status="ungraded") == 0
    r = await review.client.get("/review/api/rollouts", params={"cursor": "garbage"}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"


async def test_ungraded_and_failed_rollouts_are_listed(review: ReviewApp) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    ungraded, failed = new_trace(), new_trace()
    await review.call("read_counter", {}, ungraded, call_id="c1", run=run)
    await review.call("crash", {}, failed, call_id="c1", run=run)
    await review.call("refuse", {"reason": "no such order"}, failed, call_id="c2", run=run)
    await review.grade(failed, answer="", score=None, status="failed", errors=["judge down"])
    page = await review.api("/review/api/rollouts", run=run)
    rows = {r["trace_id"]: r for r in page["rollouts"]}
    assert rows[ungraded]["status"] is None and rows[ungraded]["call_count"] == 1
    assert rows[failed]["status"] == "failed" and rows[failed]["flags"] == ["grade_failed", "tool_errors"]
    assert [
        r["trace_id"]
        for r in (await review.api("/review/api/rollouts", run=run, status="ungraded"))["rollouts"]
    ] == [ungraded]
    stats = await review.api("/review/api/stats", run=run)
    assert stats["errors_by_outcome"] == {
        "ok": 1,
        "model_error": 1,
        "tool_crash": 1,
        "infra_error": 0,
        "call_id_reused": 0,
    }
    assert stats["reward"]["failed"] == 1 and stats["reward"]["mean"] is None
    assert stats["platform"]["tool_errors"] == 1 and stats["platform"]["model_errors"] == 1
    runs = {r["run"]: r["rollouts"] for r in await review.api("/review/api/runs")}
    assert runs[run] == 2
    flags = await review.api("/review/api/flags", run=run)
    assert {f["name"]: f["rollouts"] for f in flags} == {"grade_failed": 1, "tool_errors": 1}


async def test_an_unknown_run_has_empty_statistics(review: ReviewApp) -> None:
    stats = await review.api("/review/api/stats", run="no-such-run")
    assert stats["rollouts"] == 0 and stats["reward"]["mean"] is None and stats["tools"] == []
    assert stats["reward"]["histogram"]["counts"] == [0] * 10


async def test_compare_two_runs(review: ReviewApp) -> None:
    baseline = await seeded(review)
    tuned = await seeded(review, replace(SPEC, max_calls=4, seed=11))
    # The fine-tuned run learned item 0 (always 0 in the baseline).
    async with review.sessions() as session, session.begin():
        await session.execute(
            update(Grade).where(Grade.run == tuned.run, Grade.item_key == "id:item-00000").values(score=1.0)
        )
    comparison = await review.api("/review/api/compare", a=baseline.run, b=tuned.run)
    _, calls_a, _ = generate(baseline)
    _, calls_b, _ = generate(tuned)
    assert comparison["a"]["reward_mean"] == pytest.approx(0.5)
    assert comparison["b"]["reward_mean"] == pytest.approx(40 / 60)
    assert comparison["reward_delta"] == pytest.approx(10 / 60)
    assert comparison["calls_per_rollout_delta"] == pytest.approx((len(calls_b) - len(calls_a)) / 60)
    assert comparison["items"] == {
        "common": 6,
        "improved": 1,
        "regressed": 0,
        "unchanged": 5,
        "mean_delta": pytest.approx(1 / 6),
    }
    mix = {t["tool"]: t for t in comparison["tool_mix"]}
    assert sum(t["share_a"] for t in mix.values()) == pytest.approx(1)
    assert sum(t["calls_b"] for t in mix.values()) == len(calls_b)
    assert comparison["a"]["share_no_signal"] == pytest.approx(4 / 6)
    assert comparison["b"]["share_no_signal"] == pytest.approx(4 / 6)  # item 0 became always 1


async def test_the_review_api_needs_an_admin_key(review: ReviewApp) -> None:
    for path in ("/review/api/runs", "/review/api/rollouts", "/review/api/stats?run=x", "/export?run=x"):
        assert (await review.client.get(path)).status_code == 401
        assert (await review.client.get(path, headers=TOOLS)).status_code == 403
        assert (await review.client.get(path, headers=ADMIN)).status_code == 200


async def test_compare_and_run_pages_and_the_openapi_schema(review: ReviewApp) -> None:
    from tests.review.test_ui_auth import login

    baseline = await seeded(review)
    tuned = await seeded(review, replace(SPEC, max_calls=4, seed=11))
    await login(review)
    page = await review.client.get("/review/compare", params={"a": baseline.run, "b": tuned.run})
    assert (
        page.status_code == 200
        and '<td class="num delta" id="reward-delta">0 <span class="muted se">±' in page.text
    )
    tools = {c["tool"] for c in generate(baseline)[1]} | {c["tool"] for c in generate(tuned)[1]}
    assert page.text.count('<tr class="tool-mix-row">') == len(tools)
    # Every row of the comparison has its change, signed.
    rows = re.findall(r'<tr class="compare-row">(.*?)</tr>', page.text)
    assert len(rows) == 11
    for row in rows:
        change = re.search(
            r'<td class="num delta"[^>]*>([^<]*)(?: <span class="muted se">± [0-9.e+-]+</span>)?</td>', row
        )
        assert change and re.fullmatch(r"0( pp)?|[+−][0-9.e+]+( pp)?", change.group(1)), row
    run_page = await review.client.get("/review/run", params={"name": baseline.run})
    assert run_page.text.count('class="item-row"') == 6 and 'id="stat-no-signal">66.7%' in run_page.text
    schema = review.app.openapi()
    assert {"/review/api/stats", "/review/api/rollouts/{trace_id}", "/export"} <= set(schema["paths"])
    assert not any(path.startswith("/review/login") for path in schema["paths"])


async def test_compare_shows_histograms_item_changes_and_the_tool_mix_change(review: ReviewApp) -> None:
    from tests.review.test_ui_auth import login

    baseline = await seeded(review)
    tuned = await seeded(review, replace(SPEC, max_calls=4, seed=11))
    async with review.sessions() as session, session.begin():  # item 0 learned, item 2 forgotten
        await session.execute(
            update(Grade).where(Grade.run == tuned.run, Grade.item_key == "id:item-00000").values(score=1.0)
        )
        await session.execute(
            update(Grade).where(Grade.run == tuned.run, Grade.item_key == "id:item-00002").values(score=0.0)
        )
    comparison = await review.api("/review/api/compare", a=baseline.run, b=tuned.run)
    assert comparison["reward_histogram_a"]["counts"] == [30, 0, 0, 0, 0, 0, 0, 0, 0, 30]
    assert comparison["reward_histogram_b"]["counts"] == [25, 0, 0, 0, 0, 0, 0, 0, 0, 35]
    assert comparison["reward_histogram_a"]["edges"] == comparison["reward_histogram_b"]["edges"]
    deltas = [(d["item_key"], d["delta"]) for d in comparison["item_deltas"]]
    assert deltas[0] == ("id:item-00000", 1.0) and deltas[-1] == ("id:item-00002", -0.5)
    assert sum(t["share_delta"] for t in comparison["tool_mix"]) == pytest.approx(0, abs=1e-9)
    for t in comparison["tool_mix"]:
        assert t["share_delta"] == pytest.approx(t["share_b"] - t["share_a"])

    await login(review)
    page = (await review.client.get("/review/compare", params={"a": baseline.run, "b": tuned.run})).text
    assert page.count('data-chart="reward-a"') == page.count('data-chart="reward-b"') == 1
    assert (
        page.count('<circle class="pair improved"') == 1 and page.count('<circle class="pair regressed"') == 1
    )
    improved = page[page.index('id="items-improved"') : page.index('id="items-regressed"')]
    assert f'href="/review?item=id%3Aitem-00000&amp;run={tuned.run}"' in improved and "+1" in improved
    regressed = page[page.index('id="items-regressed"') :]
    assert "id:item-00002" in regressed and "−0.5" in regressed
