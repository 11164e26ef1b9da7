"""The review is found from the root, and the API docs open for a logged-in reviewer."""

from __future__ import annotations

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
