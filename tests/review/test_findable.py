"""The review is found from the root, and the API docs open for a logged-in reviewer."""

from __future__ import annotations

import uuid
from urllib.parse import quote

from tests.review.conftest import ADMIN, TOOLS, ReviewApp
from tests.review.test_ui_auth import login


async def test_the_root_leads_to_the_review(review: ReviewApp) -> None:
    r = await review.client.get("/")
    assert r.status_code == 303 and r.headers["location"] == "/review"


async def test_the_api_docs_open_for_a_logged_in_reviewer(review: ReviewApp) -> None:
    # Not logged in, no key: the login form, which comes back to the docs.
    r = await review.client.get("/docs")
    assert r.status_code == 303 and r.headers["location"] == "/review/login?next=/docs"
    assert (await review.client.get("/openapi.json")).status_code == 401
    assert (await review.client.get("/docs", headers=TOOLS)).status_code == 403
    assert (await review.client.get("/docs", headers=ADMIN)).status_code == 200
    done = await login(review, next="/docs")
    assert done.status_code == 303 and done.headers["location"] == "/docs"
    docs = await review.client.get("/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text
    schema = await review.client.get("/openapi.json")
    assert schema.status_code == 200 and "/review/api/curve" in schema.json()["paths"]


async def test_a_rollout_whose_trace_id_holds_a_slash_opens(review: ReviewApp) -> None:
    # The list links it with the slash escaped; the server routes on the decoded path.
    trace = f"job-{uuid.uuid4().hex[:6]}/rollout-3"
    run = f"slash-{uuid.uuid4().hex[:6]}"
    assert (await review.call("read_counter", {}, trace, call_id="c1", run=run)).status_code == 200
    await review.grade(trace, answer="42", score=1.0, run=run)
    escaped = quote(trace, safe="")
    for path in (f"/review/api/rollouts/{escaped}", f"/rollouts/{escaped}"):
        detail = await review.client.get(path, headers=ADMIN)
        assert detail.status_code == 200 and detail.json()["trace_id"] == trace, (path, detail.text[:200])
        assert len(detail.json()["timeline"]) == 1
    graded_on = await review.client.get(f"/review/api/rollouts/{escaped}/graded-on", headers=ADMIN)
    assert graded_on.status_code == 200 and graded_on.json()["trace_id"] == trace
    label = f"/review/api/rollouts/{escaped}/label"
    assert (await review.client.put(label, json={"label": "pass"}, headers=ADMIN)).status_code == 200
    assert (await review.client.get(label, headers=ADMIN)).json()["label"] == "pass"
    recomputed = await review.client.post(f"/review/api/rollouts/{escaped}/recompute-flags", headers=ADMIN)
    assert recomputed.status_code == 200 and recomputed.json()["trace_id"] == trace

    await login(review)
    listed = await review.client.get("/review", params={"run": run})
    assert f'href="/review/rollouts/{escaped}"' in listed.text
    page = await review.client.get(f"/review/rollouts/{escaped}")
    assert page.status_code == 200 and trace in page.text
    relabelled = await review.client.post(f"/review/rollouts/{escaped}/label", data={"label": "fail"})
    assert relabelled.status_code == 303
    assert (await review.client.get(label, headers=ADMIN)).json()["label"] == "fail"
