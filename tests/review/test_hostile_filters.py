"""Review filters as a hostile or careless client sends them: a clear 4xx or the answer, never a 5xx."""

from __future__ import annotations

import base64
from urllib.parse import quote

import orjson
import pytest

from tests.conftest import new_trace
from tests.review.conftest import ADMIN, ReviewApp
from tests.review.test_ui_auth import login

FILTERS = ["run", "item", "flag", "tool", "grader", "cursor"]


async def test_since_and_until_without_a_timezone_are_utc(review: ReviewApp) -> None:
    run = f"tz-{new_trace()}"
    trace = new_trace()
    assert (await review.call("read_counter", {}, trace, call_id="c1", run=run)).status_code == 200
    for since, until in (("2000-01-01T00:00:00", "2999-01-01T00:00:00"), ("2000-01-01", "2999-01-01")):
        response = await review.client.get(
            "/review/api/rollouts", params={"run": run, "since": since, "until": until}, headers=ADMIN
        )
        assert response.status_code == 200, response.text
        assert [r["trace_id"] for r in response.json()["rollouts"]] == [trace]
    empty = await review.client.get(
        "/review/api/rollouts", params={"run": run, "since": "2999-01-01T00:00:00"}, headers=ADMIN
    )
    assert empty.status_code == 200 and empty.json()["rollouts"] == []


@pytest.mark.parametrize("bad", ["a\x00b", "a\r\nSet-Cookie: x=1", "a\nb"])
async def test_control_characters_in_filters_and_ids_are_a_400(review: ReviewApp, bad: str) -> None:
    for name in FILTERS:
        for path in ("/review/api/rollouts", "/rollouts", "/export"):
            response = await review.client.get(path, params={name: bad}, headers=ADMIN)
            assert response.status_code == 400, (path, name, response.status_code, response.text[:200])
            assert response.json()["error"]["code"] == "bad_request"
    for path in (
        f"/review/api/rollouts/{quote(bad)}",
        f"/rollouts/{quote(bad)}",
        f"/review/api/rollouts/{quote(bad)}/recompute-flags",
    ):
        method = review.client.post if path.endswith("-flags") else review.client.get
        response = await method(path, headers=ADMIN)
        assert response.status_code == 400, (path, response.status_code, response.text[:200])


@pytest.mark.parametrize("run", ["€-run", "ünïcode run", 'quote" and ; semicolon', "plain"])
async def test_export_of_any_run_label_names_its_file(review: ReviewApp, run: str) -> None:
    trace = new_trace()
    label = run if run.isascii() else None  # a run label arrives in a header: ASCII; a filter may be anything
    assert (await review.call("read_counter", {}, trace, call_id="c1", run=label)).status_code == 200
    response = await review.client.get("/export", params={"run": run}, headers=ADMIN)
    assert response.status_code == 200, response.text[:200]
    disposition = response.headers["content-disposition"]
    assert disposition.isascii()
    assert f"filename*=UTF-8''{quote(f'sparring-{run}.jsonl', safe='')}" in disposition, disposition
    assert (trace in response.text) == (label is not None)


def _cursor(raw: list[object]) -> str:
    return base64.urlsafe_b64encode(orjson.dumps(raw)).decode().rstrip("=")


@pytest.mark.parametrize(
    ("sort", "raw"),
    [
        ("time", ["2026-01-01T00:00:00+00:00", "trace\x00x"]),
        ("score", ["score", 0.5, "trace\x00x"]),
        ("time", ["0001-01-01T00:00:00+14:00", "trace_x"]),
        ("time", ["9999-12-31T23:59:59-14:00", "trace_x"]),
    ],
)
async def test_a_forged_cursor_is_a_400(review: ReviewApp, sort: str, raw: list[object]) -> None:
    # Base64 hides a NUL from the check of the query; a time past the calendar once it is UTC.
    trace = new_trace()
    assert (await review.call("read_counter", {}, trace, call_id="c1", run="forged")).status_code == 200
    for order in ("desc", "asc"):
        params = {"sort": sort, "order": order, "cursor": _cursor(raw)}
        response = await review.client.get("/review/api/rollouts", params=params, headers=ADMIN)
        assert response.status_code == 400, (order, response.status_code, response.text[:200])
        assert response.json()["error"]["code"] == "bad_request"


@pytest.mark.parametrize("moment", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"])
async def test_a_time_that_is_no_utc_time_is_a_400_or_the_pages_error(review: ReviewApp, moment: str) -> None:
    for name in ("since", "until"):
        response = await review.client.get("/review/api/rollouts", params={name: moment}, headers=ADMIN)
        assert response.status_code == 400, (name, response.status_code, response.text[:200])
        assert response.json()["error"]["code"] == "bad_request"
    await login(review)
    for name in ("since", "until"):
        page = await review.client.get("/review", params={name: moment})
        assert page.status_code == 200, (name, page.status_code, page.text[:200])
        assert f"{name} must be a date and time" in page.text


@pytest.mark.parametrize("bound", ["min_score", "max_score"])
async def test_a_score_bound_that_is_not_a_number_is_refused(review: ReviewApp, bound: str) -> None:
    # NaN compares as nothing on SQLite and as above every score on Postgres: one filter, two answers.
    run = f"nan-{new_trace()}"
    trace = new_trace()
    assert (await review.call("read_counter", {}, trace, call_id="c1", run=run)).status_code == 200
    await review.grade(trace, answer="x", score=0.5, run=run)
    params = {"run": run, bound: "nan"}
    response = await review.client.get("/review/api/rollouts", params=params, headers=ADMIN)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:200])
    assert response.json()["error"]["code"] == "invalid_request"
    finite = await review.client.get("/review/api/rollouts", params={"run": run, bound: "0.5"}, headers=ADMIN)
    assert [r["trace_id"] for r in finite.json()["rollouts"]] == [trace]


@pytest.mark.parametrize("offset", [str(2**63), str(10**30)])
async def test_an_item_offset_past_64_bits_is_refused(review: ReviewApp, offset: str) -> None:
    params = {"run": "any", "offset": offset}
    response = await review.client.get("/review/api/items", params=params, headers=ADMIN)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:200])
    assert response.json()["error"]["code"] == "invalid_request"
