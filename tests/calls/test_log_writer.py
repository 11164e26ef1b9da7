"""Group commit: concurrent calls share transactions, and each answer waits for its own commit."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from app.calls.log_writer import CallLogWriter, CallRecord
from app.db.call_log import stands
from app.db.models import ANSWERED_OUTCOMES, RolloutRow, ToolCall
from app.deps import app_state
from app.sdk import Pack
from tests.conftest import AppFactory, call_body, new_trace
from tests.packs import faults_pack


async def test_concurrent_calls_share_commits_and_all_are_logged(client: httpx.AsyncClient) -> None:
    app = client.app  # type: ignore[attr-defined]
    traces = [new_trace() for _ in range(10)]
    registry = app_state(app).metrics.registry
    before = registry.get_sample_value("sparring_log_batch_size_sum")  # rows committed so far
    batches_before = registry.get_sample_value("sparring_log_batch_size_count")
    results = await asyncio.gather(
        *(
            client.post("/tools/read_counter", json=call_body("{}", trace_id=traces[i % 10], call_id=f"c{i}"))
            for i in range(80)
        )
    )
    assert all(r.status_code == 200 for r in results)
    rows = registry.get_sample_value("sparring_log_batch_size_sum") - before
    batches = registry.get_sample_value("sparring_log_batch_size_count") - batches_before
    assert rows == 80
    assert batches < 80, "80 simultaneous calls must not need 80 transactions"
    async with app_state(app).sessionmaker() as session:
        logged = await session.scalar(
            select(func.count()).select_from(ToolCall).where(ToolCall.trace_id.in_(traces))
        )
        rollouts = await session.scalar(
            select(func.count()).select_from(RolloutRow).where(RolloutRow.trace_id.in_(traces))
        )
    assert logged == 80
    assert rollouts == 10


async def test_rollout_row_keeps_first_and_last_seen_and_run(client: httpx.AsyncClient) -> None:
    app = client.app  # type: ignore[attr-defined]
    trace = new_trace()
    item = {"task_id": 7, "messages": []}
    for i in range(3):
        r = await client.post(
            "/tools/read_counter",
            json=call_body("{}", trace_id=trace, call_id=f"c{i}", item=item),
            headers={"X-Sparring-Run": "baseline-1"},
        )
        assert r.status_code == 200
    async with app_state(app).sessionmaker() as session:
        rollout = await session.get(RolloutRow, trace)
        calls = (await session.scalars(select(ToolCall).where(ToolCall.trace_id == trace))).all()
    assert rollout is not None
    assert rollout.run == "baseline-1" and rollout.item_key == "task_id:7"
    assert rollout.first_seen == min(c.started_at for c in calls)
    assert rollout.last_seen == max(c.ended_at for c in calls)


async def test_the_rollout_counts_its_logged_calls_and_each_output_size(client: httpx.AsyncClient) -> None:
    trace = new_trace()

    async def call(call_id: str, by: int) -> str:
        body = call_body({"by": by}, trace_id=trace, call_id=call_id)
        response = await client.post("/tools/increment", json=body)
        assert response.status_code == 200, response.text
        return str(response.json()["output"])

    # Parallel calls of one rollout land in one or several batches; retries are replayed: logged as
    # attempts of their own, not counted as calls.
    outputs = await asyncio.gather(*(call(f"c{i}", 1) for i in range(6)))
    await asyncio.gather(call("c0", 1), call("c1", 1))
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        rollout = await session.get(RolloutRow, trace)
        sizes = (
            await session.execute(
                select(ToolCall.outcome, ToolCall.output_bytes).where(ToolCall.trace_id == trace)
            )
        ).all()
    assert rollout is not None and rollout.calls == 6
    assert sorted(size for outcome, size in sizes if outcome == "ok") == sorted(
        len(o.encode()) for o in outputs
    )
    assert sorted(outcome for outcome, _ in sizes).count("replayed") == 2


def _record(trace: str, call_id: str | None, outcome: str = "ok", output: str | None = "out") -> CallRecord:
    now = datetime.now(UTC)
    return CallRecord(
        attempt_id=uuid.uuid4().hex,
        trace_id=trace,
        call_id=call_id,
        request_id=None,
        tool="echo",
        arguments="{}",
        output=output,
        outcome=outcome,
        error=None if outcome in (*ANSWERED_OUTCOMES, "replayed") else "failed",
        status_code={"ok": 200, "model_error": 200, "replayed": 200, "tool_crash": 500}.get(outcome, 503),
        started_at=now,
        ended_at=now,
        latency_ms=1.0,
        worker="test",
        run="writer-test",
        item_key=None,
    )


async def _counts(client: httpx.AsyncClient, traces: list[str]) -> dict[str, tuple[int, int]]:
    """trace_id -> (rollouts.calls, calls as read: app/db/call_log.py)."""
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        stored = dict(
            (
                await session.execute(
                    select(RolloutRow.trace_id, RolloutRow.calls).where(RolloutRow.trace_id.in_(traces))
                )
            ).all()
        )
        logged = dict(
            (
                await session.execute(
                    select(ToolCall.trace_id, func.count())
                    .where(ToolCall.trace_id.in_(traces), stands())
                    .group_by(ToolCall.trace_id)
                )
            ).all()
        )
    return {trace: (int(stored[trace]), int(logged.get(trace, 0))) for trace in stored}


async def test_call_counts_skip_duplicates_within_and_across_batches(client: httpx.AsyncClient) -> None:
    writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
    a, b = new_trace(), new_trace()
    # One batch: an answered call twice (two attempts, read as one call), failed calls twice (each
    # attempt is read), calls without a call_id (never deduplicated), and the same call_id on another
    # rollout.
    await writer._commit(
        [
            _record(a, "c1"),
            _record(a, "c1"),
            _record(a, "c2", "model_error", "Error: no such order"),
            _record(a, "c3", "infra_error", None),
            _record(a, "c3", "infra_error", None),
            _record(a, "c4", output="héllo"),
            _record(a, None),
            _record(a, None),
            _record(b, "c1", output=""),
        ]
    )
    assert await _counts(client, [a, b]) == {a: (7, 7), b: (1, 1)}
    # Later batches: a retried answered call (one call), a crash then its successful retry (both read).
    await writer._commit([_record(a, "c1"), _record(a, "c2", "model_error"), _record(a, "c5")])
    await writer._commit([_record(a, "c6", "tool_crash", None)])
    await writer._commit([_record(a, "c6"), _record(b, "c1")])
    assert await _counts(client, [a, b]) == {a: (10, 10), b: (1, 1)}
    # Through the queue as the service writes them.
    await asyncio.gather(writer.write(_record(b, "c1")), writer.write(_record(b, "c2")))
    assert await _counts(client, [a, b]) == {a: (10, 10), b: (2, 2)}

    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        sizes = (
            await session.execute(
                select(ToolCall.call_id, ToolCall.output, ToolCall.output_bytes).where(ToolCall.trace_id == a)
            )
        ).all()
    assert {(call_id, size) for call_id, _, size in sizes} >= {("c4", 6), ("c3", 0), ("c1", 3)}
    assert all(size == len((output or "").encode()) for _, output, size in sizes)


async def test_concurrent_writers_count_every_call_of_a_rollout(client: httpx.AsyncClient) -> None:
    """Two workers logging calls of the same rollouts at once: every increment lands (the rollout row
    is locked by the upsert), and replays of a call answered before are not counted."""
    app = client.app  # type: ignore[attr-defined]
    mine: CallLogWriter = app_state(app).log_writer
    other = CallLogWriter(
        app_state(app).engine, queue_size=10, batch_size=10, retry_after=1, metrics=app_state(app).metrics
    )
    traces = [new_trace() for _ in range(3)]
    await mine._commit([_record(traces[0], "shared")])
    batches = [
        [_record(t, f"w{w}-b{i}-{t[-4:]}") for t in traces] + [_record(traces[0], "shared", "replayed")]
        for w in range(2)
        for i in range(5)
    ]
    try:
        await asyncio.gather(*((mine if n % 2 else other)._commit(batch) for n, batch in enumerate(batches)))
    finally:
        await other.aclose()
    counts = await _counts(client, traces)
    assert counts == {traces[0]: (11, 11), traces[1]: (10, 10), traces[2]: (10, 10)}


@pytest.mark.parametrize(
    "arguments",
    [
        '{"quote": "\\"", "emoji": "🙂", "tab": "\\t"}',
        '{"q": "a\\u0000b"}',  # the six characters of a JSON escape for NUL, as text: kept as text
    ],
    ids=["escapes", "nul-escape-as-text"],
)
async def test_logged_rows_keep_every_field_exactly(client: httpx.AsyncClient, arguments: str) -> None:
    """The batch travels as JSON on Postgres: text, escapes, timestamps and floats come back unchanged."""
    writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
    trace = new_trace()
    started = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
    tricky = CallRecord(
        attempt_id=uuid.uuid4().hex,
        trace_id=trace,
        call_id='c"1\\',
        request_id="fc_ü",
        tool="echo",
        arguments=arguments,
        output='line 1\nline 2\t"quoted" \\ back\\slash, 漢字 🙂',
        outcome="model_error",
        error="Error: \r\n\u2028",
        status_code=200,
        started_at=started,
        ended_at=started.replace(microsecond=999999),
        latency_ms=0.1 + 0.2,
        worker="w-1",
        run="run/ü",
        item_key="sha256:abc",
    )
    await writer._commit([tricky])
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        row = (await session.scalars(select(ToolCall).where(ToolCall.trace_id == trace))).one()
        rollout = await session.get(RolloutRow, trace)
    for name in ("call_id", "request_id", "tool", "arguments", "output", "outcome", "error", "status_code"):
        assert getattr(row, name) == getattr(tricky, name), name
    assert (row.started_at, row.ended_at) == (tricky.started_at, tricky.ended_at)
    assert row.latency_ms == tricky.latency_ms
    assert (row.worker, row.run, row.item_key) == ("w-1", "run/ü", "sha256:abc")
    assert row.output_bytes == len(tricky.output.encode()) == tricky.output_bytes  # type: ignore[union-attr]
    assert rollout is not None and rollout.calls == 1 and rollout.first_seen == started


async def test_a_nul_character_is_answered_and_logged(client: httpx.AsyncClient) -> None:
    """Postgres text cannot hold NUL: the answer keeps it, the log (either backend) shows U+FFFD."""
    trace = new_trace()
    bodies = [call_body({"reason": "bad\u0000byte"}, trace_id=trace, call_id="nul")] + [
        call_body({"reason": f"fine {i}"}, trace_id=trace, call_id=f"ok{i}") for i in range(5)
    ]
    answers = await asyncio.gather(*(client.post("/tools/refuse", json=body) for body in bodies))
    assert [r.status_code for r in answers] == [200] * 6
    assert answers[0].json()["output"] == "Error: bad\u0000byte"
    async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
        rows = await session.execute(
            select(ToolCall.call_id, ToolCall.output).where(ToolCall.trace_id == trace, stands())
        )
        logged = {call_id: output for call_id, output in rows}
    assert len(logged) == 6
    assert logged["nul"] == "Error: bad\ufffdbyte"


unencodable_pack = Pack("unencodable")


@unencodable_pack.tool
async def crash_naming_a_file() -> str:
    """Crash with a message no UTF-8 encoder writes (a file name decoded with `surrogateescape`)."""
    await asyncio.sleep(0.01)  # while the other calls of the test run: their records share its batch
    raise RuntimeError("no file " + b"caf\xe9".decode("utf-8", "surrogateescape"))


async def test_a_crash_message_no_encoder_writes_is_logged_and_spoils_no_batch(
    app_factory: AppFactory,
) -> None:
    trace = new_trace()
    async with app_factory(packs=[unencodable_pack, faults_pack]) as client:
        crash = call_body({}, trace_id=trace, call_id="crash")
        bodies = [call_body({"reason": f"fine {i}"}, trace_id=trace, call_id=f"ok{i}") for i in range(10)]
        answers = await asyncio.gather(
            client.post("/tools/crash_naming_a_file", json=crash),
            *(client.post("/tools/refuse", json=body) for body in bodies),
        )
        assert [r.status_code for r in answers] == [500] + [200] * 10
        async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
            rows = await session.execute(
                select(ToolCall.call_id, ToolCall.outcome, ToolCall.error).where(ToolCall.trace_id == trace)
            )
            logged = {call_id: (outcome, error) for call_id, outcome, error in rows}
    assert len(logged) == 11
    outcome, error = logged["crash"]
    assert outcome == "tool_crash" and "RuntimeError: no file caf" in error


@pytest.mark.parametrize("name", ["w" * 300, None], ids=["set", "hostname"])
async def test_a_worker_name_longer_than_its_column_is_logged_on_every_backend(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch, name: str | None
) -> None:
    # A long SPARRING_WORKER_NAME, or a host's fully qualified name (up to 253 characters).
    monkeypatch.setattr("socket.gethostname", lambda: "h" * 253)
    async with app_factory(worker_name=name) as client:
        trace = new_trace()
        r = await client.post("/tools/increment", json=call_body({"by": 1}, trace_id=trace, call_id="c1"))
        assert r.status_code == 200, r.text
        async with app_state(client.app).sessionmaker() as session:  # type: ignore[attr-defined]
            [worker] = (
                await session.scalars(select(ToolCall.worker).where(ToolCall.trace_id == trace))
            ).all()
    assert len(worker) <= 128 and worker.startswith("w" * 50 if name else "h" * 50)


def _commit_threads(writer: CallLogWriter, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads the SQLite batches of `writer` commit in, as they commit."""
    batch = writer._sqlite
    assert batch is not None
    commit, threads = batch.commit, []

    def recorded(*args: Any, **options: Any) -> bool:
        threads.append(threading.current_thread().name)
        return commit(*args, **options)

    monkeypatch.setattr(batch, "commit", recorded)
    return threads


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_a_lone_call_commits_on_the_loop_and_concurrent_calls_in_the_writers_thread(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
    threads = _commit_threads(writer, monkeypatch)
    trace = new_trace()
    for i in range(3):  # one at a time: each call is the only one in flight
        response = await client.post(
            "/tools/increment", json=call_body({"by": 1}, trace_id=trace, call_id=f"a{i}")
        )
        assert response.status_code == 200
    assert threads == [threading.current_thread().name] * 3
    threads.clear()
    results = await asyncio.gather(
        *(
            client.post("/tools/increment", json=call_body({"by": 1}, trace_id=trace, call_id=f"b{i}"))
            for i in range(8)
        )
    )
    assert all(r.status_code == 200 for r in results)
    # While others are in flight a batch commits in the writer's thread; the last call may be alone.
    on_loop = [name for name in threads if not name.startswith("call-log")]
    assert threads[0].startswith("call-log") and len(on_loop) <= 1, threads
    assert (await _counts(client, [trace]))[trace] == (11, 11)


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_a_lone_commit_never_waits_on_the_loop_for_another_connections_write_lock(
    client: httpx.AsyncClient, backend_settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another connection (a retention sweep, a CLI) holds the database's write lock: the lone call's
    commit goes to the writer's thread and waits there, the event loop goes on, and the call is answered
    once the lock is released."""
    writer: CallLogWriter = app_state(client.app).log_writer  # type: ignore[attr-defined]
    threads = _commit_threads(writer, monkeypatch)
    holder = sqlite3.connect(backend_settings["database_url"].split("///", 1)[1], isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    trace = new_trace()
    try:
        call = asyncio.ensure_future(
            client.post("/tools/increment", json=call_body({"by": 1}, trace_id=trace, call_id="c1"))
        )
        ticks = 0
        for _ in range(20):  # the loop runs while the call waits for the lock
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 20 and not call.done()
        assert threads[0] == threading.current_thread().name  # tried on the loop, without waiting
        assert len(threads) == 2 and threads[1].startswith("call-log"), threads  # then waited in the thread
    finally:
        holder.execute("COMMIT")
        holder.close()
    response = await call
    assert response.status_code == 200 and response.json()["output"] == '{"value":101}'
    assert (await _counts(client, [trace]))[trace] == (1, 1)


def test_a_sqlite_batch_looks_up_each_answered_call_by_the_index(sqlite_template: Any, tmp_path: Any) -> None:
    """Whether a call of the batch was answered before is one probe of ix_tool_calls_trace_call: a batch
    costs the same in a rollout's thousandth call as in its first (not a read of every call it logged)."""
    from app.calls.log_writer import _SqliteBatch

    path = tmp_path / "log.db"
    path.write_bytes(sqlite_template.read_bytes())
    batch = _SqliteBatch(str(path))
    conn = sqlite3.connect(path)
    try:
        params = {**batch._answered_params, "trace_": "t", "call_": "c"}
        plan = " ".join(row[-1] for row in conn.execute("EXPLAIN QUERY PLAN " + batch._answered, params))
    finally:
        conn.close()
    assert "USING INDEX ix_tool_calls_trace_call (trace_id=? AND call_id=?)" in plan, plan
