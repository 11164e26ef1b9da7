"""The web pages: login form, signed HttpOnly cookie, logout, escaping of untrusted tool output."""

from __future__ import annotations

import re
import time
import uuid

from app.auth import KeyRing
from app.config import parse_api_keys
from app.review.session import COOKIE_NAME, issue_token, verify_token
from tests.conftest import ADMIN_KEY, TOOLS_KEY, new_trace
from tests.review.conftest import ADMIN, ReviewApp

PAGES = (
    "/review",
    "/review/runs",
    "/review/flags",
    "/review/compare",
    "/review/run?name=x",
    "/review/rollouts/t",
)


async def login(review: ReviewApp, key: str = ADMIN_KEY, next: str = "/review"):  # type: ignore[no-untyped-def]
    return await review.client.post("/review/login", data={"key": key, "next": next})


async def test_pages_redirect_to_the_login_form_without_a_session(review: ReviewApp) -> None:
    for page in PAGES:
        r = await review.client.get(page)
        assert r.status_code == 303, page
        assert r.headers["location"].startswith("/review/login?next=%2Freview")
    # An admin key in the header is for the API; the pages want the login session.
    assert (await review.client.get("/review", headers=ADMIN)).status_code == 303
    form = await review.client.get("/review/login?next=/review/runs")
    assert form.status_code == 200 and 'name="key"' in form.text and 'value="/review/runs"' in form.text
    assert form.headers["content-security-policy"].startswith("default-src 'none'")


async def test_a_wrong_or_non_admin_key_is_refused(review: ReviewApp) -> None:
    for key in ("not-a-key", TOOLS_KEY, ""):
        r = await login(review, key)
        assert r.status_code == 401
        assert COOKIE_NAME not in r.cookies
    r = await login(review, "not-a-key")
    assert "That is not an admin key." in r.text


async def test_login_sets_a_signed_http_only_cookie_and_logout_clears_it(review: ReviewApp) -> None:
    r = await login(review, next="/review/runs")
    assert r.status_code == 303 and r.headers["location"] == "/review/runs"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE_NAME}=")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert "Secure" not in cookie  # plain http on loopback; https gets Secure
    token = review.client.cookies[COOKIE_NAME]
    assert ADMIN_KEY not in token and len(token.split(".")) == 3
    for page in PAGES[:5]:
        assert (await review.client.get(page)).status_code == 200, page
    # The session also opens the JSON API and the export.
    assert (await review.client.get("/review/api/runs")).status_code == 200
    assert (await review.client.get("/export?run=none")).status_code == 200

    r = await review.client.post("/review/logout")
    assert r.status_code == 303 and r.headers["location"] == "/review/login"
    assert COOKIE_NAME not in review.client.cookies
    assert (await review.client.get("/review")).status_code == 303


async def test_a_tampered_or_expired_token_is_refused(review: ReviewApp) -> None:
    await login(review)
    token = review.client.cookies[COOKIE_NAME]
    expires, nonce, mac = token.split(".")
    review.client.cookies.set(COOKIE_NAME, f"{int(expires) + 3600}.{nonce}.{mac}")
    assert (await review.client.get("/review")).status_code == 303
    review.client.cookies.set(COOKIE_NAME, ADMIN_KEY)
    assert (await review.client.get("/review")).status_code == 303
    assert (await review.client.get("/review/api/runs")).status_code == 401

    ring = KeyRing(keys=tuple(parse_api_keys(f"admin:{ADMIN_KEY},tools:{TOOLS_KEY}")), header="Authorization")
    old = issue_token(ring, now=time.time() - 13 * 3600)
    assert not verify_token(ring, old)
    fresh = issue_token(ring)
    assert verify_token(ring, fresh)
    rotated = KeyRing(keys=tuple(parse_api_keys("admin:another-admin-key")), header="Authorization")
    assert not verify_token(rotated, fresh)  # changing the admin keys ends every session


async def test_a_cookie_that_is_not_ascii_is_no_session(review: ReviewApp) -> None:
    # A header's bytes arrive as Latin-1: a forged cookie may hold any of them, with no key at all.
    forged = f"{int(time.time()) + 3600}.nonce.".encode() + "signé".encode()
    for cookie in (f"{COOKIE_NAME}=".encode() + forged, f"{COOKIE_NAME}=1.a.\xe9".encode("latin-1")):
        assert (await review.client.get("/review", headers={"cookie": cookie})).status_code == 303
        assert (await review.client.get("/review/api/runs", headers={"cookie": cookie})).status_code == 401
        assert (await review.client.get("/review/login", headers={"cookie": cookie})).status_code == 200


async def test_login_never_redirects_off_site(review: ReviewApp) -> None:
    for target in ("https://evil.example/", "//evil.example/review", "/review\\@evil", "javascript:alert(1)"):
        r = await login(review, next=target)
        assert r.headers["location"] == "/review", target


async def test_tool_output_is_escaped_and_pages_show_the_rollout(review: ReviewApp) -> None:
    run = f"run-{uuid.uuid4().hex[:8]}"
    trace = new_trace()
    payload = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    await review.call("echo", {"text": payload}, trace, call_id="c1", run=run, item={"id": "xss-1"})
    for i in range(3):
        await review.call("read_counter", {}, trace, call_id=f"r{i}", run=run)
    await review.grade(trace, answer=f"Done: {payload}", score=1.0, item={"id": "xss-1"}, run=run)
    await login(review)

    page = await review.client.get(f"/review/rollouts/{trace}")
    assert page.status_code == 200
    assert "<script>" not in page.text and "<img src=x" not in page.text
    assert "&lt;script&gt;alert(" in page.text
    assert len(re.findall(r'<article class="call', page.text)) == 4
    assert 'data-flag="repeated_call"' in page.text
    assert page.headers["x-frame-options"] == "DENY"

    table = await review.client.get("/review", params={"run": run, "flag": "repeated_call"})
    assert table.status_code == 200 and table.text.count('class="rollout-row"') == 1 and trace in table.text
    empty = await review.client.get("/review", params={"run": run, "flag": "over_budget"})
    assert empty.text.count('class="rollout-row"') == 0 and "No rollouts match." in empty.text
    bad = await review.client.get("/review", params={"min_score": "lots"})
    assert bad.status_code == 200 and "min score must be a number" in bad.text

    run_page = await review.client.get("/review/run", params={"name": run})
    assert (
        run_page.status_code == 200 and run_page.text.count('data-chart="') == 8
    )  # 4 over time, 4 distributions
    flags_page = await review.client.get("/review/flags", params={"run": run, "flag": "repeated_call"})
    assert 'data-flag="repeated_call"' in flags_page.text and trace in flags_page.text
    missing = await review.client.get("/review/rollouts/trace_missing")
    assert missing.status_code == 404 and "no rollout" in missing.text
    css = await review.client.get("/review/static/review.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")

    recompute = await review.client.post(f"/review/rollouts/{trace}/recompute-flags")
    assert recompute.status_code == 303 and recompute.headers["location"] == f"/review/rollouts/{trace}"


async def test_a_call_s_json_shows_its_numbers_as_logged(review: ReviewApp) -> None:
    # An account number past 64 bits in an output: shown with every digit, not as a rounded float.
    trace = new_trace()
    account = "12345678901234567890123"
    await review.call("echo", {"text": f'{{"account": {account}, "balance": 10.5}}'}, trace, call_id="c1")
    await login(review)
    page = await review.client.get(f"/review/rollouts/{trace}")
    assert page.status_code == 200
    assert account in page.text and "1.2345678901234568e+22" not in page.text


async def test_login_and_logout_refuse_cross_origin_posts(review: ReviewApp) -> None:
    evil = {"Origin": "https://evil.example"}
    r = await review.client.post("/review/login", data={"key": ADMIN_KEY, "next": "/review"}, headers=evil)
    assert r.status_code == 403 and COOKIE_NAME not in r.cookies
    r = await review.client.post(
        "/review/login", data={"key": ADMIN_KEY}, headers={"Sec-Fetch-Site": "cross-site"}
    )
    assert r.status_code == 403
    # The page's own origin, or no Origin at all (a script, not a browser), logs in.
    same = await review.client.post(
        "/review/login", data={"key": ADMIN_KEY}, headers={"Origin": "http://sparring"}
    )
    assert same.status_code == 303 and COOKIE_NAME in review.client.cookies
    forged = await review.client.post("/review/logout", headers=evil)
    assert forged.status_code == 403
    assert (await review.client.get("/review")).status_code == 200, "a cross-site logout ended nothing"


async def test_logout_revokes_the_token_on_the_server(review: ReviewApp) -> None:
    assert (await login(review)).status_code == 303
    stolen = review.client.cookies[COOKIE_NAME]
    assert (await review.client.get("/review/api/runs")).status_code == 200
    assert (await review.client.post("/review/logout")).status_code == 303
    # A copy of the cookie (another tab, a proxy log, an attacker) no longer opens anything.
    assert COOKIE_NAME not in review.client.cookies
    copy = {"Cookie": f"{COOKIE_NAME}={stolen}"}
    assert (await review.client.get("/review", headers=copy)).status_code == 303
    assert (await review.client.get("/review/api/runs", headers=copy)).status_code == 401
    # A new login is a new token.
    assert (await login(review)).status_code == 303
    assert review.client.cookies[COOKIE_NAME] != stolen
    assert (await review.client.get("/review/api/runs")).status_code == 200
