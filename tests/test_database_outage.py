"""With the database unreachable, the services behind the grade, remote and health routes answer 503
with Retry-After through the one database boundary (`app.db.session.Database`), and what must go on
through an outage (the remote slot, a failed grade's record) still does."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

from app.db.session import Database, build_engine, build_sessionmaker
from app.deps import app_state
from tests.conftest import ADMIN_KEY, AppFactory, new_trace
from tests.grading.test_routes import GRADERS, write_graders
from tests.remote.processor import Row, init_request

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when the block ends: nothing listens there


@asynccontextmanager
async def database_down(client: httpx.AsyncClient, backend: str, tmp_path: Path) -> AsyncIterator[None]:
    """Every service's database boundary (and the routes') on a database nobody can reach."""
    url = (
        f"postgresql+asyncpg://postgres@127.0.0.1:{closed_port()}/none"
        if backend == "real"
        else f"sqlite+aiosqlite:///{tmp_path / 'missing' / 'dir' / 'x.db'}"
    )
    down = build_engine(url, pool_size=1)
    state = app_state(client.app)  # type: ignore[attr-defined]
    healthy = state.sessionmaker
    unreachable = Database(build_sessionmaker(down), state.settings.retry_after_seconds)
    services = (state.grading, state.remote)
    kept = [service.database for service in services]
    state.sessionmaker = unreachable.sessions
    for service in services:
        service.database = unreachable
    try:
        yield
    finally:
        state.sessionmaker = healthy
        for service, database in zip(services, kept, strict=True):
            service.database = database
        await down.dispose()


def assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text[:300]
    assert response.headers["retry-after"] == "2"
    assert response.json()["error"]["code"] == "unavailable"


async def test_services_answer_503_while_the_database_is_down(
    app_factory: AppFactory, backend: str, tmp_path: Path
) -> None:
    graders = write_graders(tmp_path, {"exact": GRADERS["exact"]})
    async with app_factory(key=ADMIN_KEY, graders_file=graders, remote_allowed_hosts=["127.0.0.1"]) as client:
        row = Row.new()
        body = init_request(
            row,
            model="m",
            model_base_url="http://127.0.0.1:9/v1",  # an allowed host; the database fails first
            messages=[{"role": "user", "content": "hi"}],
        )
        grade = {"sample": {"output_text": "a"}, "item": {"reference_answer": "a"}}
        async with database_down(client, backend, tmp_path):
            assert_unavailable(await client.get("/readyz"))
            # Grading: reading the rollout's calls, and storing the grade.
            assert_unavailable(await client.post("/grade/exact", json={**grade, "trace_id": new_trace()}))
            assert_unavailable(await client.post("/grade/exact", json=grade))
            # Remote rollouts: the init is refused and gives its slot back; the status cannot be read.
            assert_unavailable(await client.post("/remote/init", json=body))
            assert app_state(client.app).remote.in_flight == 0  # type: ignore[attr-defined]
            assert_unavailable(await client.get("/remote/status", params={"rollout_id": row.rollout_id}))
        # Back up: the same requests are answered.
        assert (await client.get("/readyz")).status_code == 200
        assert (await client.post("/grade/exact", json=grade)).json() == {"score": 1.0}
        unknown = await client.get("/remote/status", params={"rollout_id": row.rollout_id})
        assert unknown.status_code == 404
