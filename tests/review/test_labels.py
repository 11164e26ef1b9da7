"""People's labels: the API (admin key or review session), the rollout page's form, the list filter,
the export, and the stratified labelling queue."""

from __future__ import annotations

import html
import re
import uuid

import orjson
import pytest

from app.review import labels as labels_module
from app.review.label_repository import QueueCandidate
from app.review.labels import band_of, stratified
from app.review.session import COOKIE_NAME
from tests.conftest import new_trace
from tests.review.conftest import ADMIN, ReviewApp


async def graded_run(review: ReviewApp, scores: list[float], *, items: int = 2) -> tuple[str, list[str]]:
    run = f"labels-{uuid.uuid4().hex[:8]}"
    traces = []
    for i, score in enumerate(scores):
        trace = new_trace()
        item = {"id": f"item-{i % items}"}
        await review.call("echo", {"text": "hi"}, trace, call_id="c1", run=run, item=item)
        await review.grade(trace, answer=f"answer {i}", score=score, item=item, run=run)
        traces.append(trace)
    return run, traces


async def test_labels_through_the_api_the_list_and_the_export(review: ReviewApp) -> None:
    run, (a, b, c) = await graded_run(review, [1.0, 0.0, 0.5])
    url = f"/review/api/rollouts/{a}/label"
    put = await review.client.put(url, json={"label": "pass", "note": " right answer "}, headers=ADMIN)
    assert put.status_code == 200, put.text
    assert put.json()["label"] == "pass" and put.json()["note"] == "right answer"
    assert put.json()["labelled_by"] == "admin"
    # A second label replaces the first.
    await review.client.put(f"/review/api/rollouts/{b}/label", json={"label": "pass"}, headers=ADMIN)
    again = await review.client.put(f"/review/api/rollouts/{b}/label", json={"label": "fail"}, headers=ADMIN)
    assert again.json()["label"] == "fail" and again.json()["note"] is None
    assert (await review.api(f"/review/api/rollouts/{b}/label"))["label"] == "fail"

    def listed(page: dict[str, object]) -> dict[str, object]:
        return {r["trace_id"]: r["label"] for r in page["rollouts"]}  # type: ignore[attr-defined,index]

    assert listed(await review.api("/review/api/rollouts", run=run)) == {a: "pass", b: "fail", c: None}
    assert set(listed(await review.api("/review/api/rollouts", run=run, label="pass"))) == {a}
    assert set(listed(await review.api("/review/api/rollouts", run=run, label="fail"))) == {b}
    unlabelled = await review.api("/review/api/rollouts", run=run, label="unlabelled", count="true")
    assert set(listed(unlabelled)) == {c} and unlabelled["total"] == 1

    exported = await review.client.get("/export", params={"run": run}, headers=ADMIN)
    labels = {line["trace_id"]: line["label"] for line in map(orjson.loads, exported.content.splitlines())}
    assert labels[a]["label"] == "pass" and labels[a]["note"] == "right answer"
    assert labels[b]["label"] == "fail" and labels[c] is None

    deleted = await review.client.delete(url, headers=ADMIN)
    assert deleted.status_code == 204
    assert (await review.client.delete(url, headers=ADMIN)).status_code == 404
    assert (await review.client.get(url, headers=ADMIN)).status_code == 404
    assert listed(await review.api("/review/api/rollouts", run=run))[a] is None


async def test_bad_label_requests_are_4xx(review: ReviewApp) -> None:
    _, (trace,) = await graded_run(review, [1.0])
    url = f"/review/api/rollouts/{trace}/label"
    assert (await review.client.put(url, json={"label": "pass"})).status_code == 401  # no key, no session
    bad = await review.client.put(url, json={"label": "maybe"}, headers=ADMIN)
    assert bad.status_code == 422 and "error" in bad.json()
    unknown = await review.client.put(
        f"/review/api/rollouts/{new_trace()}/label", json={"label": "pass"}, headers=ADMIN
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
    too_long = await review.client.put(url, json={"label": "fail", "note": "x" * 5000}, headers=ADMIN)
    assert too_long.status_code == 422


async def test_the_page_labels_and_walks_the_queue(review: ReviewApp) -> None:
    run, traces = await graded_run(review, [1.0, 0.0, 1.0, 0.0])
    await review.client.post("/review/login", data={"key": "admin-key-789", "next": "/review"})
    assert COOKIE_NAME in review.client.cookies
    queue_page = await review.client.get(f"/review/runs/{run}/queue")
    assert queue_page.status_code == 200 and "4</strong> unlabelled" in queue_page.text
    queue = await review.client.get(f"/review/api/runs/{run}/queue")  # the session opens the API too
    order = [e["trace_id"] for e in queue.json()["rollouts"]]
    assert sorted(order) == sorted(traces)

    page = await review.client.get(f"/review/rollouts/{order[0]}", params={"queue": run})
    assert 'accesskey="p"' in page.text and 'accesskey="f"' in page.text
    assert f"/review/rollouts/{order[1]}?queue={run}" in page.text  # "next" skips to the queue's next
    labelled = await review.client.post(
        f"/review/rollouts/{order[0]}/label", data={"label": "fail", "note": "wrong total", "queue": run}
    )
    assert labelled.status_code == 303
    # The queue's next rollout, as the queue reads once this one is labelled.
    after = [e["trace_id"] for e in (await review.api(f"/review/api/runs/{run}/queue"))["rollouts"]]
    assert order[0] not in after and len(after) == 3
    assert labelled.headers["location"] == f"/review/rollouts/{after[0]}?queue={run}"
    stored = await review.api(f"/review/api/rollouts/{order[0]}/label")
    assert (stored["label"], stored["note"], stored["labelled_by"]) == ("fail", "wrong total", "session")
    shown = await review.client.get(f"/review/rollouts/{order[0]}")
    assert "wrong total" in shown.text and 'id="current-label"' in shown.text

    counts = (await review.client.get(f"/review/api/runs/{run}/queue")).json()
    assert (counts["unlabelled"], counts["labelled"]) == (3, 1)
    removed = await review.client.post(f"/review/rollouts/{order[0]}/label", data={"label": "remove"})
    assert removed.status_code == 303
    assert (await review.client.get(f"/review/api/rollouts/{order[0]}/label")).status_code == 404
    cross_site = await review.client.post(
        f"/review/rollouts/{order[0]}/label", data={"label": "pass"}, headers={"Sec-Fetch-Site": "cross-site"}
    )
    assert cross_site.status_code == 403


async def test_skipping_walks_the_whole_queue(review: ReviewApp) -> None:
    # Skipping from the queue's second rollout goes on to its third, not back to its first: a reviewer
    # who skips twice must not be stuck between two rollouts.
    run, _ = await graded_run(review, [1.0, 0.0, 1.0, 0.0, 0.5])
    await review.client.post("/review/login", data={"key": "admin-key-789", "next": "/review"})
    order = [e["trace_id"] for e in (await review.api(f"/review/api/runs/{run}/queue"))["rollouts"]]
    for here, following in zip(order, [*order[1:], order[0]], strict=True):  # past the last: the first
        page = await review.client.get(f"/review/rollouts/{here}", params={"queue": run})
        skip = re.search(r'<a id="queue-next" href="([^"]+)"', page.text)
        assert skip is not None
        assert html.unescape(skip.group(1)) == f"/review/rollouts/{following}?queue={run}"


async def test_a_note_holding_nul_is_stored_with_u_fffd_on_both_backends(review: ReviewApp) -> None:
    # Postgres text cannot hold NUL: as everywhere else, it is stored as U+FFFD, never a 503.
    _, (trace,) = await graded_run(review, [1.0])
    url = f"/review/api/rollouts/{trace}/label"
    put = await review.client.put(url, json={"label": "pass", "note": "a\x00b"}, headers=ADMIN)
    assert put.status_code == 200, put.text
    assert put.json()["note"] == "a\ufffdb"
    await review.client.post("/review/login", data={"key": "admin-key-789", "next": "/review"})
    form = {"label": "fail", "note": "c\x00d"}
    posted = await review.client.post(f"/review/rollouts/{trace}/label", data=form)
    assert posted.status_code == 303
    stored = await review.api(url)
    assert (stored["label"], stored["note"]) == ("fail", "c\ufffdd")


def candidates(spec: list[tuple[str, float | None, int]]) -> list[QueueCandidate]:
    out = []
    for item, score, count in spec:
        out += [QueueCandidate(f"{item}-{score}-{i}", item, score) for i in range(count)]
    return out


def test_the_queue_spreads_over_score_bands_and_items() -> None:
    # A run dominated by one item scoring 1: the queue still draws from every band and item.
    pool = candidates([("a", 1.0, 90), ("b", 1.0, 5), ("c", 0.0, 3), ("d", 0.6, 1), ("e", None, 1)])
    first = stratified(pool, 8)
    assert {band_of(c.score) for c in first[:4]} == {"0-0.25", "0.5-0.75", "0.75-1", "ungraded"}
    assert {c.item_key for c in first} == {"a", "b", "c", "d", "e"}
    assert stratified(pool, 8) == first  # the same queue on every reload
    assert len(stratified(pool, 500)) == 100 and len(set(stratified(pool, 500))) == 100
    assert stratified([], 5) == []


def test_score_bands() -> None:
    assert [band_of(s) for s in (0.0, 0.25, 0.49, 0.5, 0.99, 1.0, 7.0, -1.0, None)] == [
        "0-0.25",
        "0.25-0.5",
        "0.25-0.5",
        "0.5-0.75",
        "0.75-1",
        "0.75-1",
        "0.75-1",
        "0-0.25",
        "ungraded",
    ]


async def test_the_queue_counts_every_unlabelled_rollout(
    review: ReviewApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The queue draws from at most QUEUE_CAP rollouts; the count of unlabelled ones is over the run.
    monkeypatch.setattr(labels_module, "QUEUE_CAP", 3)
    run, traces = await graded_run(review, [1.0, 0.0, 0.5, 0.25, 0.75])
    await review.client.put(f"/review/api/rollouts/{traces[0]}/label", json={"label": "pass"}, headers=ADMIN)
    queue = await review.api(f"/review/api/runs/{run}/queue")
    assert (queue["unlabelled"], queue["labelled"], len(queue["rollouts"])) == (4, 1, 3)
