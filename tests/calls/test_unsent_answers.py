"""The answer is logged while the store keeps it; when keeping it fails, the log must not say it was sent.

A call's log record commits at the same time as the store's `finish` (they overlap, see
ToolCallService._finish). If `finish` then fails, the caller gets a 503 and the record, which may
already be committed, is voided: it stays as that attempt's infra_error, and the retry logs its own
answer. An attempt whose answer goes out while such a row is still there takes the row over.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import replace
from datetime import timedelta
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import select, update

from app.calls.log_writer import CallLogWriter, CallRecord
from app.db.models import RolloutRow, ToolCall
from app.deps import app_state
from app.rollouts.redis_store import _keys
from app.rollouts.store import StoreUnavailable
from app.sdk import Pack, ToolContext
from tests.calls.test_log_writer import _record
from tests.conftest import REDIS_URL, AppFactory, call_body, new_trace

lapsing_pack = Pack("lapsing")
_lost: set[tuple[str, str | None]] = set()
_attempts = itertools.count(1)


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
    return {"key": key, "attempt": str(next(_attempts))}  # each attempt answers differently


_claim_lost, _go_on = threading.Event(), threading.Event()


@lapsing_pack.tool
def look_up_slowly(ctx: ToolContext, key: str) -> dict[str, str]:
    """As look_up, but the first attempt then stalls until the test lets it go on."""
    first = (ctx.trace_id, ctx.call_id) not in _lost
    answer = look_up(ctx, key)
    if first:
        _claim_lost.set()
        _go_on.wait(10)
    return answer


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
            rollout = await session.get(RolloutRow, trace)
        assert rollout is not None and rollout.calls == 2  # both attempts are logged calls


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_an_answer_sent_while_a_failed_attempt_voids_its_row_takes_the_row_over(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt A logs its answer, loses its claim, and holds its void; attempt B of the same call runs
    meanwhile, its record meets A's row, and its answer is sent. The log must keep B's answer."""
    trace = new_trace()
    async with app_factory(packs=[lapsing_pack]) as client:
        writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
        voiding, go_on = asyncio.Event(), asyncio.Event()
        void = writer.void

        async def held_void(record: CallRecord, **kwargs: Any) -> None:
            voiding.set()
            await go_on.wait()
            await void(record, **kwargs)

        monkeypatch.setattr(writer, "void", held_void)
        body = call_body({"key": "k"}, trace_id=trace, call_id="c1")
        first = asyncio.create_task(client.post("/tools/look_up", json=body))
        await asyncio.wait_for(voiding.wait(), 10)
        assert [(r.outcome, r.status_code) for r in await _rows(client, trace)] == [("ok", 200)]  # A's

        second = await client.post("/tools/look_up", json=body)
        assert second.status_code == 200, second.text
        go_on.set()
        assert (await first).status_code == 503
        rows = await _rows(client, trace)
        assert [(r.outcome, r.status_code, r.output) for r in rows] == [("ok", 200, second.json()["output"])]
        replay = await client.post("/tools/look_up", json=body)
        assert replay.json()["output"] == second.json()["output"]
        assert len(await _rows(client, trace)) == 1


async def test_a_record_whose_call_has_an_answered_row_says_so_and_can_take_it_over(
    client: httpx.AsyncClient,
) -> None:
    writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
    trace = new_trace()
    first = _record(trace, "c1", output="first")
    later = first.started_at + timedelta(seconds=1)
    retry = replace(first, started_at=later, ended_at=later, output="retry")
    failed = replace(
        first, started_at=first.started_at + timedelta(seconds=2), outcome="infra_error", output=None
    )
    assert await writer.write(first) is True
    assert await writer.write(retry) is False  # kept out: the call has its answered row
    assert await writer.write(failed) is True  # not an answer: always its own row
    await writer.take_over(retry)
    await writer.void(first, reason="matches nothing: the row is the retry's now")
    rows = await _rows(client, trace)
    assert sorted((r.output or "", r.outcome) for r in rows) == [("", "infra_error"), ("retry", "ok")]
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        rollout = await session.get(RolloutRow, trace)
    assert rollout is not None and rollout.calls == 2
    # In the other order: voided first, the record that takes over gets a row of its own.
    other = new_trace()
    first, retry = replace(first, trace_id=other), replace(retry, trace_id=other)
    await writer.write(first)
    await writer.void(first, reason="the state store failed")
    await writer.take_over(retry)
    rows = await _rows(client, other)
    assert sorted((r.output, r.outcome, r.status_code) for r in rows if r.output) == [("retry", "ok", 200)]
    assert len(rows) == 2


async def test_voiding_marks_only_that_attempt(client: httpx.AsyncClient) -> None:
    writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
    trace = new_trace()
    record = _record(trace, "c1", output="never sent")
    other_attempt = replace(record, started_at=record.started_at - timedelta(seconds=1), output="other")
    no_call_id = replace(_record(trace, None, output="no call id"), started_at=record.started_at)
    await asyncio.gather(writer.write(record), writer.write(no_call_id))
    await writer.write(other_attempt)  # another attempt of the same call_id, but not answered twice
    await writer.void(record, reason="the state store failed")

    rows = {(r.call_id, r.output, r.outcome, r.status_code) for r in await _rows(client, trace)}
    assert rows == {("c1", None, "infra_error", 503), (None, "no call id", "ok", 200)}
    # Voided, the attempt left the answered-calls index: the retry's answer is logged in its own row.
    retry = replace(record, started_at=record.started_at + timedelta(seconds=1), output="sent")
    await writer.write(retry)
    await writer.void(replace(record, tool="another_tool"), reason="matches nothing")
    rows = {(r.call_id, r.output, r.outcome, r.status_code) for r in await _rows(client, trace)}
    assert ("c1", "sent", "ok", 200) in rows and ("c1", None, "infra_error", 503) in rows
    assert len(rows) == 3


async def test_an_answer_the_store_kept_though_its_finish_failed_is_logged_when_replayed(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store applied the finish but its reply was lost: nothing was sent, so the attempt's row is
    voided; the retry replays the stored answer (the tool does not run again) and logs it."""
    trace = new_trace()
    async with app_factory() as client:
        store = app_state(client.app).store  # type: ignore[attr-defined]
        finish = store.finish

        async def reply_lost(*args: Any) -> None:
            await finish(*args)
            raise StoreUnavailable("rollout state store did not answer within 5 s")

        monkeypatch.setattr(store, "finish", reply_lost)
        body = call_body({"by": 1}, trace_id=trace, call_id="c1")
        first = await client.post("/tools/increment", json=body)
        assert first.status_code == 503, first.text
        assert [(r.outcome, r.status_code) for r in await _rows(client, trace)] == [("infra_error", 503)]
        monkeypatch.setattr(store, "finish", finish)
        retry = await client.post("/tools/increment", json=body)
        assert retry.status_code == 200 and retry.json()["output"] == '{"value":101}'  # applied once
        rows = sorted((r.outcome, r.status_code, r.output or "") for r in await _rows(client, trace))
        assert rows == [("infra_error", 503, ""), ("ok", 200, '{"value":101}')]


async def test_a_replay_takes_the_row_over_whatever_it_says(client: httpx.AsyncClient) -> None:
    """A replay's record meets the call's answered row. It takes the row over: the row might be a
    failed attempt's that is being voided (and might even say the same), and the replay's answer is
    going out."""
    trace = new_trace()
    body = call_body({"by": 2}, trace_id=trace, call_id="c1")
    first = await client.post("/tools/increment", json=body)
    assert first.status_code == 200
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        # As if the row were one a failed attempt logged with its own answer and has not voided yet.
        await session.execute(update(ToolCall).where(ToolCall.trace_id == trace).values(output="stale"))
        await session.commit()
        (logged_first,) = (await session.scalars(select(ToolCall).where(ToolCall.trace_id == trace))).all()
    replay = await client.post("/tools/increment", json=body)
    assert replay.json()["output"] == first.json()["output"]
    rows = await _rows(client, trace)
    assert [(r.outcome, r.output) for r in rows] == [("ok", first.json()["output"])]
    # The replay's attempt now, in the call's place in the timeline (its first start).
    assert rows[0].ended_at > logged_first.ended_at and rows[0].started_at == logged_first.started_at
    again = await client.post("/tools/increment", json=body)  # the same answer: taken over again
    assert again.json()["output"] == first.json()["output"]
    rows_after = await _rows(client, trace)
    assert len(rows_after) == 1 and rows_after[0].ended_at > rows[0].ended_at
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        rollout = await session.get(RolloutRow, trace)
    assert rollout is not None and rollout.calls == 1


async def test_a_model_error_under_a_used_call_id_leaves_the_answered_row_alone(
    client: httpx.AsyncClient,
) -> None:
    trace = new_trace()
    first = await client.post("/tools/increment", json=call_body({"by": 1}, trace_id=trace, call_id="c1"))
    assert first.json()["output"] == '{"value":101}'
    # Arguments the tool refuses before the ledger is asked: an Error the model reads, not a retry.
    wrong = await client.post("/tools/increment", json=call_body({"by": "x"}, trace_id=trace, call_id="c1"))
    assert wrong.status_code == 200 and wrong.json()["output"].startswith("Error:")
    rows = await _rows(client, trace)
    assert [(r.outcome, r.output) for r in rows if r.outcome == "ok"] == [("ok", '{"value":101}')]


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_a_failed_attempt_whose_record_met_the_answer_sent_is_logged_as_its_failure(
    app_factory: AppFactory,
) -> None:
    """Attempt A stalls after losing its claim; attempt B runs, answers and is logged; then A's record
    meets B's row and A's finish fails: B's row stays, and A is logged as its infra_error."""
    trace = new_trace()
    _claim_lost.clear()
    _go_on.clear()
    async with app_factory(packs=[lapsing_pack]) as client:
        body = call_body({"key": "k"}, trace_id=trace, call_id="c1")
        first = asyncio.create_task(client.post("/tools/look_up_slowly", json=body))
        assert await asyncio.to_thread(_claim_lost.wait, 10)
        second = await client.post("/tools/look_up_slowly", json=body)
        assert second.status_code == 200, second.text
        _go_on.set()
        assert (await first).status_code == 503
        rows = sorted((r.outcome, r.status_code, r.output or "") for r in await _rows(client, trace))
        assert rows == [("infra_error", 503, ""), ("ok", 200, second.json()["output"])]
