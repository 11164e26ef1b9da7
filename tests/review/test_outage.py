"""With the database unreachable, every review route answers 503 with Retry-After (the house rule)."""

from __future__ import annotations

import socket

from app.db.session import build_engine, build_sessionmaker
from app.deps import app_state
from tests.conftest import new_trace
from tests.review.conftest import ADMIN, ReviewApp
from tests.review.test_ui_auth import login


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when the block ends: nothing listens there


async def test_review_routes_answer_503_while_the_database_is_down(review: ReviewApp) -> None:
    trace = new_trace()
    await review.call("read_counter", {}, trace, call_id="c1", run="outage")
    await login(review)
    healthy = app_state(review.app).sessionmaker
    down = build_engine(f"postgresql+asyncpg://postgres@127.0.0.1:{closed_port()}/none", pool_size=1)
    app_state(review.app).sessionmaker = build_sessionmaker(down)
    try:
        for path in (
            "/review/api/runs",
            "/review/api/rollouts?run=outage",
            f"/review/api/rollouts/{trace}",
            "/review/api/stats?run=outage",
            "/review/api/items?run=outage",
            "/review/api/compare?a=outage&b=other",
            "/review/api/flags",
            "/export?run=outage",
            "/review?run=outage",
            f"/review/rollouts/{trace}",
            "/review/run?name=outage",
        ):
            r = await review.client.get(path, headers=ADMIN)
            assert r.status_code == 503, (path, r.status_code, r.text)
            assert r.headers["retry-after"] == "2"
            assert r.json()["error"]["code"] == "unavailable"
        r = await review.client.post(f"/review/api/rollouts/{trace}/recompute-flags", headers=ADMIN)
        assert r.status_code == 503
    finally:
        app_state(review.app).sessionmaker = healthy
        await down.dispose()
    assert (await review.client.get("/export?run=outage", headers=ADMIN)).status_code == 200
