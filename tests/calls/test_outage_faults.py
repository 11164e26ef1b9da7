"""Redis and Postgres behind proxies that reset connections mid-load: every failure a 503, never a 500."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
import uvloop
from asgi_lifespan import LifespanManager
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from app.calls import log_writer
from app.main import create_app
from tests.call_log import logged_calls_on
from tests.conftest import ADMIN_KEY, REDIS_URL, TOOLS_KEY, make_settings, new_trace
from tests.faults import DroppingProxy
from tests.packs import counter_pack

pytestmark = pytest.mark.slow


def _proxied(url: str, proxy: DroppingProxy) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{proxy.port}"
    return parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host).geturl()


async def _load_under_drops(
    home: Path, database_url: str
) -> tuple[list[httpx.Response], list[httpx.Response]]:
    """The responses under drops, and those of the retries of the calls that failed, after them."""
    pg, redis = urlsplit(database_url), urlsplit(REDIS_URL)
    pg_proxy = await DroppingProxy(pg.hostname or "127.0.0.1", pg.port or 5432).start()
    redis_proxy = await DroppingProxy(redis.hostname or "127.0.0.1", redis.port or 6379).start()
    settings = make_settings(
        home,
        database_url=_proxied(database_url, pg_proxy),
        redis_url=_proxied(REDIS_URL, redis_proxy),
    )
    app = create_app(settings, packs=[counter_pack])
    responses: list[httpx.Response] = []
    retries: list[httpx.Response] = []

    async def rollout(client: httpx.AsyncClient) -> None:
        trace = new_trace()
        for k in range(12):
            body = {"trace_id": trace, "call_id": f"c{k}", "arguments": {"by": 1}}
            responses.append(await client.post("/tools/increment", json=body))
            responses.append(
                await client.get(f"/rollouts/{trace}", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            )

    async def dropper() -> None:
        while True:
            await asyncio.sleep(0.004)
            pg_proxy.drop()
            redis_proxy.drop()

    try:
        async with LifespanManager(app) as manager:
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(
                transport=transport,
                base_url="http://sparring",
                headers={"Authorization": f"Bearer {TOOLS_KEY}"},
                timeout=30,
            ) as client:
                dropping = asyncio.create_task(dropper())
                try:
                    await asyncio.wait_for(asyncio.gather(*(rollout(client) for _ in range(16))), 120)
                finally:
                    dropping.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await dropping
                # The drops over, the trainer retries the calls of even number that failed until each
                # is answered; it gives the others up.
                failed = [r for r in responses if r.request.method == "POST" and r.status_code != 200]
                for response in failed:
                    if int(orjson.loads(response.request.content)["call_id"][1:]) % 2:
                        continue
                    retried = response
                    for _ in range(50):
                        retried = await client.post("/tools/increment", content=response.request.content)
                        if retried.status_code == 200:
                            break
                        await asyncio.sleep(0.1)
                    retries.append(retried)
    finally:
        await pg_proxy.aclose()
        await redis_proxy.aclose()
    return responses, retries


def test_connections_reset_mid_load_answer_503_never_500(tmp_path: Path, pg_database: str) -> None:
    responses, retries = uvloop.run(_load_under_drops(tmp_path / "home", pg_database))
    statuses = Counter(r.status_code for r in responses)
    assert statuses[503] > 0, f"the drops must have failed some requests: {statuses}"
    unexpected: list[Any] = [
        (r.status_code, r.text[:300]) for r in responses if r.status_code not in (200, 404, 503)
    ]
    assert not unexpected, (statuses, unexpected[:5])
    for response in responses:
        if response.status_code == 503:
            assert response.headers.get("Retry-After"), response.text
            error = response.json()["error"]
            assert set(error) >= {"code", "message"}
            # What the driver said (hosts, ports, error kinds) stays in the server's log.
            assert "127.0.0.1" not in response.text and str(urlsplit(REDIS_URL).port) not in response.text
    assert all(r.status_code == 200 for r in retries), Counter(r.status_code for r in retries)
    uvloop.run(_every_call_reads_as_the_answer_sent(responses + retries, pg_database))


async def _every_call_reads_as_the_answer_sent(responses: list[httpx.Response], database_url: str) -> None:
    """Every call answered reads in the log (app/db/call_log.py) as answered once, with the output that
    was sent: nothing answered is missing; and a call given up reads as no answer: no attempt whose
    answer was never sent (voided, or failed before its answer was logged) reads as answered."""
    sent: dict[tuple[str, str], str] = {}
    called: set[tuple[str, str]] = set()
    for response in responses:
        if response.request.method == "POST":
            body = orjson.loads(response.request.content)
            called.add((body["trace_id"], body["call_id"]))
            if response.status_code == 200:
                sent[(body["trace_id"], body["call_id"])] = response.json()["output"]
    gave_up = called - set(sent)
    engine = create_async_engine(database_url, poolclass=NullPool)
    try:
        rows = await logged_calls_on(engine, {trace for trace, _ in called})
    finally:
        await engine.dispose()
    answers: dict[tuple[str, str], list[str | None]] = {}
    for row in rows:
        if row["outcome"] in ("ok", "replayed"):
            answers.setdefault((row["trace_id"], row["call_id"]), []).append(row["output"])
    wrong = {key: answers.get(key) for key, output in sent.items() if answers.get(key) != [output]}
    assert not wrong, (len(wrong), list(wrong.items())[:5])
    unsent = set(answers) - set(sent)  # calls given up: their attempts' answers were never sent
    assert not unsent, (len(unsent), [(key, answers[key]) for key in list(unsent)[:5]])
    assert gave_up, "the test must give some failed calls up"


async def test_a_database_that_stops_answering_is_a_503_not_a_hang(
    tmp_path: Path, pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Postgres stalls (a partition without a reset): the call log's batch gives up at its deadline, the
    call is a 503 with Retry-After (the trainer retries), and once it answers again the retry is answered
    from the ledger."""
    monkeypatch.setattr(log_writer, "COMMIT_TIMEOUT_SECONDS", 1.0)
    pg = urlsplit(pg_database)
    proxy = await DroppingProxy(pg.hostname or "127.0.0.1", pg.port or 5432).start()
    app = create_app(
        make_settings(tmp_path / "home", database_url=_proxied(pg_database, proxy), redis_url=REDIS_URL),
        packs=[counter_pack],
    )
    trace = new_trace()
    try:
        async with LifespanManager(app) as manager:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=manager.app),
                base_url="http://sparring",
                headers={"Authorization": f"Bearer {TOOLS_KEY}"},
            ) as client:
                body = {"trace_id": trace, "call_id": "c1", "arguments": {"by": 1}}
                before = await client.post("/tools/increment", json={**body, "call_id": "c0"})
                proxy.stalled = True
                stalled = await asyncio.wait_for(client.post("/tools/increment", json=body), 30)
                proxy.stalled = False
                proxy.drop()  # what the stall left half-sent
                retried = await asyncio.wait_for(client.post("/tools/increment", json=body), 30)
    finally:
        await proxy.aclose()
    assert before.status_code == 200
    assert stalled.status_code == 503 and "retry-after" in stalled.headers, stalled.text
    assert retried.status_code == 200 and retried.json()["output"] == '{"value":102}', retried.text  # once
