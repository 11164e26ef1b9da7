"""The answer is logged while the store keeps it; when keeping it fails, the log must not say it was sent.

A call's log record commits at the same time as the store's `finish` (they overlap, see
ToolCallService._finish). If `finish` then fails, the caller gets a 503 and the attempt's row, which
may already be committed, is voided: it stays as that attempt's infra_error. Every attempt has its
own row (a replay too), and the call's answer is read from them (app/db/call_log.py): nothing
answered is ever missing, and nothing unsent reads as answered.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from dataclasses import replace
from datetime import timedelta
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import select

from app.calls.log_writer import CallLogWriter, CallRecord, LogUnavailable
from app.db.call_log import logged_calls
from app.db.models import RolloutRow, ToolCall
from app.deps import app_state
from app.rollouts.redis_store import _keys
from app.rollouts.store import StoreUnavailable
from app.sdk import Pack, ToolContext
from tests.calls.test_log_writer import _record
from tests.conftest import ADMIN_KEY, REDIS_KEY_PREFIX, REDIS_URL, AppFactory, call_body, new_trace

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
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
            client.delete(_keys(ctx.trace_id, ctx.call_id, REDIS_KEY_PREFIX)[2])
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
    """Every attempt logged for the rollout, in the order they were logged."""
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        query = select(ToolCall).where(ToolCall.trace_id == trace).order_by(ToolCall.id)
        return list((await session.scalars(query)).all())


async def _read(client: httpx.AsyncClient, trace: str) -> list[Any]:
    """The rollout's calls as the timeline, the counts, the flags and the statistics read them."""
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        return list((await session.execute(logged_calls(ToolCall.trace_id == trace))).all())


async def _calls_counted(client: httpx.AsyncClient, trace: str) -> int:
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        rollout = await session.get(RolloutRow, trace)
    assert rollout is not None
    return rollout.calls


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
        again = await client.post("/tools/look_up", json=body)  # replayed from the ledger: its own row
        assert again.json()["output"] == retry.json()["output"]
        rows = await _rows(client, trace)
        assert [(r.outcome, r.status_code, r.output) for r in rows] == [
            ("infra_error", 503, None),
            ("ok", 200, retry.json()["output"]),
            ("replayed", 200, retry.json()["output"]),
        ]
        assert len({r.attempt_id for r in rows}) == 3
        read = await _read(client, trace)
        assert [(r.outcome, r.output) for r in read] == [
            ("infra_error", None),
            ("ok", retry.json()["output"]),
        ]
        assert read[1].started_at == rows[0].started_at  # the answer at the call's first start
        assert await _calls_counted(client, trace) == 2  # the failure and the answer; not the replay


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_an_answer_sent_while_a_failed_attempt_voids_its_row_is_the_calls_answer(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt A logs its answer, loses its claim, and holds its void; attempt B of the same call runs
    meanwhile and its answer is sent. A's row reads as its failure, B's as the call's answer."""
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
        sent = second.json()["output"]
        # Before the void: B's answer is already the one read (the last answered attempt).
        assert [(r.outcome, r.output) for r in await _read(client, trace)] == [("ok", sent)]
        go_on.set()
        assert (await first).status_code == 503
        rows = await _rows(client, trace)
        assert [(r.outcome, r.output) for r in rows] == [("infra_error", None), ("ok", sent)]
        read = await _read(client, trace)
        assert [(r.outcome, r.output) for r in read] == [("infra_error", None), ("ok", sent)]
        assert read[1].started_at == rows[0].started_at
        replay = await client.post("/tools/look_up", json=body)
        assert replay.json()["output"] == sent
        assert [r.outcome for r in await _rows(client, trace)] == ["infra_error", "ok", "replayed"]
        assert [(r.outcome, r.output) for r in await _read(client, trace)][-1] == ("ok", sent)


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_a_void_the_database_refused_goes_in_later(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database refuses the void while the 503 goes out (it is still dropping connections): the
    void goes on in the background, so the row of the unsent answer does not stay answered."""
    trace = new_trace()
    async with app_factory(packs=[lapsing_pack]) as client:
        writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
        void, tries = writer.void, []

        async def refused_twice(record: CallRecord, **kwargs: Any) -> None:
            tries.append(record.attempt_id)
            if len(tries) <= 2:
                raise LogUnavailable("call log database unreachable", retry_after=1)
            await void(record, **kwargs)

        monkeypatch.setattr(writer, "void", refused_twice)
        body = call_body({"key": "k"}, trace_id=trace, call_id="c1")
        first = await client.post("/tools/look_up", json=body)
        assert first.status_code == 503, first.text
        assert len(tries) == 1
        assert [(r.outcome, r.output is None) for r in await _rows(client, trace)] == [("ok", False)]
        for _ in range(100):
            rows = await _rows(client, trace)
            if rows[0].outcome != "ok":
                break
            await asyncio.sleep(0.05)
        assert [(r.outcome, r.status_code, r.output) for r in rows] == [("infra_error", 503, None)]
        assert len(tries) == 3 and len(set(tries)) == 1
        assert await _calls_counted(client, trace) == 1


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_a_commit_whose_reply_was_lost_is_voided_and_the_retry_replays(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call log's commit went in but its reply was lost (the connection dropped during COMMIT):
    the caller gets a 503, so the row is voided; the retry replays the stored answer, and that replay
    is the call's answer as read."""
    trace = new_trace()
    async with app_factory(packs=[lapsing_pack]) as client:
        writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
        commit, lost = writer._commit, []

        async def reply_lost(records: list[CallRecord], **options: Any) -> None:
            await commit(records, **options)
            if not lost:
                lost.append(records)
                raise OSError("connection was closed in the middle of operation")

        monkeypatch.setattr(writer, "_commit", reply_lost)
        body = call_body({"key": "k"}, trace_id=trace, call_id="c2")
        _lost.add((trace, "c2"))  # the tool keeps its claim: storing the answer succeeds
        first = await client.post("/tools/look_up", json=body)
        assert first.status_code == 503, first.text
        assert first.headers.get("Retry-After")
        for _ in range(100):
            rows = await _rows(client, trace)
            if rows and rows[0].outcome != "ok":
                break
            await asyncio.sleep(0.05)
        assert [(r.outcome, r.output) for r in rows] == [("infra_error", None)]
        retry = await client.post("/tools/look_up", json=body)
        assert retry.status_code == 200, retry.text
        assert [r.outcome for r in await _rows(client, trace)] == ["infra_error", "replayed"]
        read = await _read(client, trace)
        sent = retry.json()["output"]
        # The tool did not run again: the replay sends the answer stored by the first attempt.
        assert [(r.outcome, r.output) for r in read] == [("infra_error", None), ("replayed", sent)]
        assert read[0].started_at == read[1].started_at == rows[0].started_at


async def test_the_answer_is_the_last_answered_attempt_at_the_calls_first_start(
    client: httpx.AsyncClient,
) -> None:
    writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
    trace = new_trace()
    first = _record(trace, "c1", output="first")
    at = first.started_at

    def attempt(seconds: int, **changes: Any) -> CallRecord:
        later = at + timedelta(seconds=seconds)
        return replace(first, attempt_id=uuid.uuid4().hex, started_at=later, ended_at=later, **changes)

    retry = attempt(1, output="retry")
    failed = attempt(2, outcome="infra_error", output=None)
    replayed = attempt(3, outcome="replayed", output="retry")
    for record in (first, retry, failed, replayed):
        await writer.write(record)
    read = await _read(client, trace)
    assert [(r.outcome, r.output, r.started_at) for r in read] == [
        ("ok", "retry", at),  # the last attempt that ran, not its replay, placed at the first start
        ("infra_error", None, at + timedelta(seconds=2)),
    ]
    assert await _calls_counted(client, trace) == 2
    # A voided attempt is not read as the answer: the one before it is again.
    await writer.void(retry, reason="the state store failed")
    assert [(r.outcome, r.output) for r in await _read(client, trace)] == [
        ("ok", "first"),
        ("infra_error", None),
        ("infra_error", None),
    ]
    assert await _calls_counted(client, trace) == 3  # the voided attempt is a failure of its own
    # With every attempt that ran voided, the replay that was sent is the answer: never missing.
    await writer.void(first, reason="the state store failed")
    read = await _read(client, trace)
    answers = [(r.outcome, r.output, r.started_at) for r in read if r.output is not None]
    assert answers == [("replayed", "retry", at)]
    assert [r.outcome for r in read].count("infra_error") == 3
    assert await _calls_counted(client, trace) == len(read) == 4


async def test_a_void_then_a_retry_count_as_a_failure_and_an_answer(client: httpx.AsyncClient) -> None:
    writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
    trace = new_trace()
    first = _record(trace, "c1", output="never sent")
    later = first.started_at + timedelta(seconds=1)
    retry = replace(first, attempt_id=uuid.uuid4().hex, started_at=later, ended_at=later, outcome="replayed")
    await writer.write(first)
    await writer.void(first, reason="the state store failed")
    await writer.write(retry)
    read = await _read(client, trace)
    assert [(r.outcome, r.output) for r in read] == [("infra_error", None), ("replayed", "never sent")]
    assert await _calls_counted(client, trace) == 2


async def test_voiding_marks_only_that_attempt(client: httpx.AsyncClient) -> None:
    writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
    trace = new_trace()
    record = _record(trace, "c1", output="never sent")
    # Another attempt alike in everything (call, tool, worker, start and end) but its attempt id.
    twin = replace(record, attempt_id=uuid.uuid4().hex, output="sent")
    no_call_id = replace(_record(trace, None, output="no call id"), started_at=record.started_at)
    await asyncio.gather(writer.write(record), writer.write(no_call_id), writer.write(twin))
    await writer.void(record, reason="the state store failed")
    rows = {(r.call_id, r.output, r.outcome, r.status_code) for r in await _rows(client, trace)}
    assert rows == {
        ("c1", None, "infra_error", 503),
        ("c1", "sent", "ok", 200),
        (None, "no call id", "ok", 200),
    }
    await writer.void(replace(record, attempt_id=uuid.uuid4().hex), reason="matches nothing")
    assert len({r.output for r in await _rows(client, trace)}) == 3


async def test_an_answer_the_store_kept_though_its_finish_failed_is_logged_when_replayed(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store applied the finish but its reply was lost: nothing was sent, so the attempt's row is
    voided; the retry replays the stored answer (the tool does not run again), and that replay is
    the call's answer as read."""
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
        rows = [(r.outcome, r.status_code, r.output) for r in await _rows(client, trace)]
        assert rows == [("infra_error", 503, None), ("replayed", 200, '{"value":101}')]
        read = [(r.outcome, r.output) for r in await _read(client, trace)]
        assert read == [("infra_error", None), ("replayed", '{"value":101}')]
        assert await _calls_counted(client, trace) == 2
        timeline = (await client.get(f"/rollouts/{trace}", headers=ADMIN)).json()
        assert [c["outcome"] for c in timeline["timeline"]] == ["infra_error", "replayed"]
        assert timeline["call_count"] == 2


async def test_a_replay_is_its_own_replayed_row(client: httpx.AsyncClient) -> None:
    """A retry answered from the ledger is logged as an attempt of its own, outcome `replayed`; the
    call still reads as the attempt that ran, once, in its place."""
    trace = new_trace()
    body = call_body({"by": 2}, trace_id=trace, call_id="c1")
    first = await client.post("/tools/increment", json=body)
    assert first.status_code == 200
    for _ in range(2):
        replay = await client.post("/tools/increment", json=body)
        assert replay.json()["output"] == first.json()["output"]
    rows = await _rows(client, trace)
    assert [(r.outcome, r.output) for r in rows] == [
        ("ok", first.json()["output"]),
        ("replayed", first.json()["output"]),
        ("replayed", first.json()["output"]),
    ]
    assert rows[1].started_at > rows[0].started_at and len({r.attempt_id for r in rows}) == 3
    read = await _read(client, trace)
    assert [(r.outcome, r.started_at, r.ended_at) for r in read] == [
        ("ok", rows[0].started_at, rows[0].ended_at)
    ]
    assert await _calls_counted(client, trace) == 1
    timeline = (await client.get(f"/rollouts/{trace}", headers=ADMIN)).json()
    assert [c["outcome"] for c in timeline["timeline"]] == ["ok"] and timeline["call_count"] == 1


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
    assert [(r.outcome, r.output) for r in rows] == [
        ("ok", '{"value":101}'),
        ("model_error", wrong.json()["output"]),
    ]
    # Both were sent: the call reads as the last one the model got.
    assert [r.outcome for r in await _read(client, trace)] == ["model_error"]


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_a_failed_attempt_whose_answer_was_logged_after_the_answer_sent_reads_as_its_failure(
    app_factory: AppFactory,
) -> None:
    """Attempt A stalls after losing its claim; attempt B runs, answers and is logged; then A's answer
    is logged and A's finish fails: B's answer stays the call's, and A reads as its infra_error."""
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
        read = sorted((r.outcome, r.output or "") for r in await _read(client, trace))
        assert read == [("infra_error", ""), ("ok", second.json()["output"])]
        assert await _calls_counted(client, trace) == 2
