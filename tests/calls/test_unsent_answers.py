"""The answer is logged while the store keeps it; when keeping it fails, the log must not say it was sent.

A call's log record commits at the same time as the store's `finish` (they overlap, see
ToolCallService._finish). If `finish` then fails, the caller gets a 503 and the record, which may
already be committed, is voided: it stays as that attempt's infra_error, and the retry logs its own
answer.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta

import httpx
import pytest
import redis
from sqlalchemy import select

from app.calls.log_writer import CallLogWriter
from app.db.models import Rollout, ToolCall
from app.deps import app_state
from app.rollouts.redis_store import _keys
from app.sdk import Pack, ToolContext
from tests.calls.test_log_writer import _record
from tests.conftest import REDIS_URL, AppFactory, call_body, new_trace

lapsing_pack = Pack("lapsing")
_lost: set[tuple[str, str | None]] = set()


@lapsing_pack.tool
def look_up(ctx: ToolContext, key: str) -> dict[str, str]:
    """Read a value; the first attempt of each call loses its claim while it runs (a stalled worker
    whose claim lapsed and was taken over), so storing its answer fails."""
    if (ctx.trace_id, ctx.call_id) not in _lost:
        _lost.add((ctx.trace_id, ctx.call_id))
        client = redis.Redis.from_url(REDIS_URL)
        try:
            client.delete(_keys(ctx.trace_id, ctx.call_id)[2])
        finally:
            client.close()
    return {"key": key, "attempt": str(len(_lost))}


async def _rows(client: httpx.AsyncClient, trace: str) -> list[ToolCall]:
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        return list((await session.scalars(select(ToolCall).where(ToolCall.trace_id == trace))).all())


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_an_answer_the_store_could_not_keep_is_not_logged_as_sent(app_factory: AppFactory) -> None:
    trace = new_trace()
    async with app_factory(packs=[lapsing_pack]) as client:
        body = call_body({"key": "k"}, trace_id=trace, call_id="c1")
        first = await client.post("/tools/look_up", json=body)
        assert first.status_code == 503, first.text
        assert first.headers.get("Retry-After")
        rows = await _rows(client, trace)
        assert [(r.outcome, r.status_code, r.output) for r in rows] == [("infra_error", 503, None)]
        assert rows[0].error and "claim lapsed" in rows[0].error

        retry = await client.post("/tools/look_up", json=body)
        assert retry.status_code == 200, retry.text
        again = await client.post("/tools/look_up", json=body)  # replayed from the ledger, logged once
        assert again.json()["output"] == retry.json()["output"]
        rows = await _rows(client, trace)
        sent = [r for r in rows if r.status_code == 200]
        assert [r.output for r in sent] == [retry.json()["output"]]
        assert sorted(r.outcome for r in rows) == ["infra_error", "ok"]
        async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
            rollout = await session.get(Rollout, trace)
        assert rollout is not None and rollout.calls == 2  # both attempts are logged calls


async def test_voiding_marks_only_that_attempt(client: httpx.AsyncClient) -> None:
    writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
    trace = new_trace()
    record = _record(trace, "c1", output="never sent")
    other_attempt = replace(record, started_at=record.started_at - timedelta(seconds=1), output="other")
    no_call_id = replace(_record(trace, None, output="no call id"), started_at=record.started_at)
    await asyncio.gather(writer.write(record), writer.write(no_call_id))
    await writer.write(other_attempt)  # another attempt of the same call_id, but not answered twice
    await writer.void(record, "the state store failed")

    rows = {(r.call_id, r.output, r.outcome, r.status_code) for r in await _rows(client, trace)}
    assert rows == {("c1", None, "infra_error", 503), (None, "no call id", "ok", 200)}
    # Voided, the attempt left the answered-calls index: the retry's answer is logged in its own row.
    retry = replace(record, started_at=record.started_at + timedelta(seconds=1), output="sent")
    await writer.write(retry)
    await writer.void(replace(record, tool="another_tool"), "matches nothing")
    rows = {(r.call_id, r.output, r.outcome, r.status_code) for r in await _rows(client, trace)}
    assert ("c1", "sent", "ok", 200) in rows and ("c1", None, "infra_error", 503) in rows
    assert len(rows) == 3
