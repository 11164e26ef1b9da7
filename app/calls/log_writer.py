"""The call log writer: many requests share one transaction (group commit), each awaits its batch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
import orjson
from sqlalchemy import bindparam, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db.models import (
    ANSWERED_OUTCOMES,
    ANSWERED_ROW,
    LOGGED_CALL_COLUMNS,
    LOGGED_ROLLOUT_COLUMNS,
    RolloutRow,
    ToolCall,
)
from app.db.text import storable
from app.errors import ServiceUnavailable
from app.metrics import Metrics

log = logging.getLogger(__name__)


class LogUnavailable(ServiceUnavailable):
    code = "call_log_unavailable"


@dataclass(slots=True)
class CallRecord:
    trace_id: str
    call_id: str | None
    request_id: str | None
    tool: str
    arguments: str
    output: str | None
    outcome: str
    error: str | None
    status_code: int
    started_at: datetime
    ended_at: datetime
    latency_ms: float
    worker: str
    run: str | None
    item_key: str | None
    channel: str = "rft"  # rft: the tool routes; mcp: the MCP server (HTTP or stdio)
    output_bytes: int = field(init=False)  # the output's UTF-8 size, as sent

    def __post_init__(self) -> None:
        self.output_bytes = len(self.output.encode()) if self.output else 0


# A failed commit: SQLAlchemy's errors, and asyncpg's (the batch statement is sent to it directly).
_COMMIT_ERRORS = (SQLAlchemyError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError)

# A queued record and its writer's future: True once committed in its own row, False when its call
# already had an answered row (see CallLogWriter.enqueue).
_Pending = tuple[CallRecord, asyncio.Future[bool] | None]
# What names one attempt of a call in the log: trace_id and call_id as stored, and its start.
_AttemptKey = tuple[str, str, datetime]

# The columns the writer fills (CallRecord's fields), derived from the ORM tables.
_CALL_COLUMNS, _ROLLOUT_COLUMNS = LOGGED_CALL_COLUMNS, LOGGED_ROLLOUT_COLUMNS


def _recordset(param: str, alias: str, columns: tuple[tuple[str, str], ...]) -> str:
    definition = ", ".join(f"{name} {kind}" for name, kind in columns)
    return f"json_to_recordset(CAST({param} AS json)) AS {alias}({definition})"


def _postgres_batch_sql() -> str:
    """A whole batch in one statement: log the calls, then upsert their rollouts adding the number of
    calls actually inserted (a call answered before, replayed from the ledger, conflicts on
    uq_tool_calls_answered and is neither logged nor counted twice). It returns the number of answered
    calls inserted: when that is all of them (nearly always), no call's writer needs to be told that
    its call already had an answered row.

    The rows travel as two JSON documents ($1 the calls, $2 their rollouts; one orjson call each)
    rather than an array per column, which the driver would encode value by value, and the statement
    goes to asyncpg directly (prepared once per connection). Together that is a third of the client
    CPU that SQLAlchemy with column arrays took per batch. One statement is one
    transaction, so the batch is committed atomically in one round trip. Running it again after an
    unknown outcome cannot count a call twice either. The rollouts are upserted in trace_id order,
    so two workers' batches lock shared rollouts in the same order.
    """
    names = ", ".join(name for name, _ in _CALL_COLUMNS)
    return f"""
        WITH logged AS (
            INSERT INTO tool_calls ({names})
            SELECT {names} FROM {_recordset("$1", "c_", _CALL_COLUMNS)}
            ON CONFLICT DO NOTHING
            RETURNING trace_id, call_id IS NOT NULL AND outcome IN ('ok', 'model_error') AS answered
        ), counted AS (
            SELECT trace_id, count(*) AS n FROM logged GROUP BY trace_id
        ), touched AS (
        INSERT INTO rollouts (trace_id, run, item_key, channel, first_seen, last_seen, calls)
        SELECT r_.trace_id, r_.run, r_.item_key, r_.channel, r_.first_seen, r_.last_seen,
               coalesce(counted.n, 0)
        FROM {_recordset("$2", "r_", _ROLLOUT_COLUMNS)}
        LEFT JOIN counted ON counted.trace_id = r_.trace_id
        ORDER BY r_.trace_id
        ON CONFLICT (trace_id) DO UPDATE SET
            first_seen = least(rollouts.first_seen, excluded.first_seen),
            last_seen = greatest(rollouts.last_seen, excluded.last_seen),
            run = coalesce(rollouts.run, excluded.run),
            item_key = coalesce(rollouts.item_key, excluded.item_key),
            channel = coalesce(rollouts.channel, excluded.channel),
            calls = rollouts.calls + excluded.calls
        )
        SELECT count(*) FILTER (WHERE answered) FROM logged
        """


# The answered rows of some calls ($1 trace ids, $2 call ids, pairwise): which attempts have them.
_ANSWERED_ATTEMPTS_SQL = """
    SELECT t.trace_id, t.call_id, t.started_at
    FROM tool_calls t JOIN unnest($1::varchar[], $2::varchar[]) AS k(trace_id, call_id)
      ON t.trace_id = k.trace_id AND t.call_id = k.call_id
    WHERE t.outcome IN ('ok', 'model_error')
"""


class CallLogWriter:
    """Batches call records into one INSERT per transaction; `write` returns once its batch is durable."""

    def __init__(
        self, engine: AsyncEngine, *, queue_size: int, batch_size: int, retry_after: int, metrics: Metrics
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=queue_size)
        self._batch_size = batch_size
        self._retry_after = retry_after
        self._task: asyncio.Task[None] | None = None
        self.last_batch_size = 0
        self._postgres = engine.dialect.name == "postgresql"
        # Postgres: one statement per batch on a connection the writer keeps (no pool round trips).
        self._conn: AsyncConnection | None = None
        self._conn_lock = asyncio.Lock()
        self._idle_since = 0.0
        self._batch_sql = _postgres_batch_sql()
        # SQLite: the same work in three statements. Built once, so SQLAlchemy compiles them once.
        insert: Any = sqlite.insert
        rollouts = RolloutRow.__table__
        upsert = insert(rollouts)
        self._rollout_upsert = upsert.on_conflict_do_update(
            index_elements=[rollouts.c.trace_id],
            set_={
                "first_seen": func.min(rollouts.c.first_seen, upsert.excluded.first_seen),
                "last_seen": func.max(rollouts.c.last_seen, upsert.excluded.last_seen),
                "run": func.coalesce(rollouts.c.run, upsert.excluded.run),
                "item_key": func.coalesce(rollouts.c.item_key, upsert.excluded.item_key),
                "channel": func.coalesce(rollouts.c.channel, upsert.excluded.channel),
            },
        )
        # A call answered before (a retry replayed from the ledger) is already logged: skip it.
        self._calls_insert = insert(ToolCall.__table__).on_conflict_do_nothing()
        calls = ToolCall.__table__
        self._answered_attempts = select(calls.c.trace_id, calls.c.call_id, calls.c.started_at).where(
            calls.c.trace_id.in_(bindparam("traces", expanding=True)),
            calls.c.call_id.is_not(None),
            calls.c.outcome.in_(ANSWERED_OUTCOMES),
        )
        self._recount = (
            update(RolloutRow)
            .where(RolloutRow.trace_id.in_(bindparam("traces", expanding=True)))
            .values(
                calls=select(func.count())
                .select_from(calls)
                .where(calls.c.trace_id == RolloutRow.trace_id)
                .scalar_subquery()
            )
        )

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="call-log-writer")

    async def write(self, record: CallRecord) -> bool:
        """Queue the record and wait until it is committed; 503 when the queue is full or the DB fails.

        True when the record is logged in its own row; False when its call (trace_id and call_id)
        already had an answered row, which was kept (see `take_over`).
        """
        return await self.enqueue(record)

    def enqueue(self, record: CallRecord) -> asyncio.Future[bool]:
        """Queue the record now; the future is done when its batch is committed (or failed: 503),
        with `write`'s result.

        LogUnavailable at once when the queue is full. A caller that still has work to do before it
        answers (storing the answer in the ledger) does it while the batch commits, then awaits.
        """
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait((record, future))
        except asyncio.QueueFull:
            raise LogUnavailable(
                "call log is saturated; retry shortly", retry_after=self._retry_after
            ) from None
        return future

    async def void(self, record: CallRecord, *, reason: str, status_code: int = 503) -> None:
        """Turn the logged answer of `record` into the failure it became: the answer was logged while
        the store was keeping it, keeping it failed, and the caller got `status_code` instead.

        The row stays (a logged attempt, counted like any other) but no longer says what was never
        sent: outcome infra_error, no output. It leaves the answered-calls unique index, so the retry's
        answer is logged in its own row. Matched by the attempt's own trace, call, tool, worker, start
        and end: a row that was never committed, or that another attempt took over meanwhile
        (`take_over`), matches nothing. Tried up to three times; LogUnavailable if it never went in.
        """
        match = storable({"trace_id": record.trace_id, "call_id": record.call_id, "tool": record.tool})
        same_call = (
            ToolCall.call_id == match["call_id"] if record.call_id is not None else ToolCall.call_id.is_(None)
        )
        statement = (
            update(ToolCall)
            .where(
                ToolCall.trace_id == match["trace_id"],
                same_call,
                ToolCall.tool == match["tool"],
                ToolCall.worker == record.worker,
                ToolCall.started_at == record.started_at,
                ToolCall.ended_at == record.ended_at,
                ToolCall.outcome.in_(ANSWERED_OUTCOMES),
            )
            .values(
                outcome="infra_error",
                status_code=status_code,
                error=storable(reason),
                output=None,
                output_bytes=0,
            )
        )

        async def run(conn: AsyncConnection) -> None:
            await conn.execute(statement)

        await self._short_transaction(run)

    async def take_over(self, record: CallRecord) -> None:
        """Log `record` in place of the answered row its call already has: its answer is the one sent.

        `write` keeps the first answered row of a call. But that row may be one a failing attempt
        logged while the store was keeping its answer, and is voiding (see `void`). An attempt whose
        answer is going out, and whose record met such a row, takes the row over: with its own
        answer, arguments, worker and end, keeping the row's start (the call's place in the
        timeline), so the void, before or after, matches nothing. A row inserted (the void
        came first) adds one to its rollout's `calls`. LogUnavailable when the database fails: the
        answer is not sent, and the retry replays it from the ledger.
        """
        row = _without_nul(record)
        insert: Any = postgresql.insert if self._postgres else sqlite.insert
        upsert = insert(ToolCall.__table__).values(**row)
        upsert = upsert.on_conflict_do_update(
            index_elements=["trace_id", "call_id"],
            index_where=text(ANSWERED_ROW),
            # Everything but the start: the row keeps the call's place in the rollout's timeline.
            set_={name: upsert.excluded[name] for name in row if name != "started_at"},
        )
        counted = update(RolloutRow).where(RolloutRow.trace_id == row["trace_id"])

        async def run(conn: AsyncConnection) -> None:
            if self._postgres:
                # Whether it inserted: a row the upsert updated carries the updating transaction's
                # xmax. The increment, unlike a count, cannot miss a batch committing meanwhile.
                inserted = (await conn.execute(upsert.returning(text("xmax = 0")))).scalar()
                if inserted:
                    await conn.execute(counted.values(calls=RolloutRow.calls + 1))
            else:  # one writer at a time: the count is taken again
                await conn.execute(upsert)
                await conn.execute(self._recount, {"traces": [row["trace_id"]]})

        await self._short_transaction(run)

    async def _short_transaction(self, work: Callable[[AsyncConnection], Awaitable[None]]) -> None:
        """`work(conn)` in a transaction of its own, tried three times; LogUnavailable if it never went in."""
        failure: BaseException | None = None
        for attempt in range(3):
            try:
                async with asyncio.timeout(_SHORT_TIMEOUT_SECONDS):
                    async with self._engine.begin() as conn:
                        await work(conn)
                return
            except (*_COMMIT_ERRORS, TimeoutError) as exc:
                failure = exc
                log.warning("call log: a correction failed (attempt %d of 3): %s", attempt + 1, exc)
                await asyncio.sleep(0.05 * 4**attempt)
        raise LogUnavailable("call log database unreachable", retry_after=self._retry_after) from failure

    def submit(self, record: CallRecord) -> None:
        """Best effort, without waiting (used for calls that already failed with a 503)."""
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait((record, None))

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._batch_size:
                try:
                    batch.append(self._queue.get_nowait())
                except asyncio.QueueEmpty:
                    break
            self.last_batch_size = len(batch)
            self._metrics.log_batch_size.observe(len(batch))
            self._metrics.log_queue_depth.set(self._queue.qsize())
            try:
                kept_out = await self._commit([record for record, _ in batch])
            except asyncio.CancelledError:
                for _, future in batch:
                    if future is not None and not future.done():
                        future.set_exception(
                            LogUnavailable("server shutting down", retry_after=self._retry_after)
                        )
                raise
            except _COMMIT_ERRORS as exc:
                log.warning("call log commit failed for %d calls: %s", len(batch), exc)
                error = LogUnavailable("call log database unreachable", retry_after=self._retry_after)
                for _, future in batch:
                    if future is not None and not future.done():
                        future.set_exception(error)
            except Exception:  # a bug must not kill the writer task
                log.exception("call log commit failed")
                for _, future in batch:
                    if future is not None and not future.done():
                        future.set_exception(LogUnavailable("call log failed", retry_after=self._retry_after))
            else:
                for record, future in batch:
                    if future is not None and not future.done():
                        future.set_result(not kept_out or _attempt_key(record) not in kept_out)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _commit(self, records: list[CallRecord]) -> set[_AttemptKey]:
        """Log the records; the answered ones not inserted because their call had an answered row."""
        rollouts: dict[str, dict[str, Any]] = {}
        for record in records:
            row = rollouts.get(record.trace_id)
            if row is None:
                rollouts[record.trace_id] = {
                    "trace_id": record.trace_id,
                    "run": record.run,
                    "item_key": record.item_key,
                    "channel": record.channel,
                    "first_seen": record.started_at,
                    "last_seen": record.ended_at,
                }
            else:
                row["first_seen"] = min(row["first_seen"], record.started_at)
                row["last_seen"] = max(row["last_seen"], record.ended_at)
                row["run"] = row["run"] or record.run
                row["item_key"] = row["item_key"] or record.item_key
        # Rollouts in a fixed order, so two workers upserting the same rollouts cannot deadlock.
        traces = sorted(rollouts)
        # The records that claim their call's answered row: the only ones a batch may skip.
        answered = [r for r in records if r.call_id is not None and r.outcome in ANSWERED_OUTCOMES]
        if self._postgres:
            return await self._commit_postgres(records, [rollouts[key] for key in traces], answered)
        rows = [_without_nul(record) for record in records]
        rollout_rows = [storable(rollouts[key]) for key in traces]
        stored_traces = [row["trace_id"] for row in rollout_rows]
        async with self._engine.begin() as conn:
            # The upsert locks each rollout row first, so concurrent batches of one rollout take turns
            # and each recount sees the calls the other committed.
            await conn.execute(self._rollout_upsert, rollout_rows)
            await conn.execute(self._calls_insert, rows)
            await conn.execute(self._recount, {"traces": stored_traces})
            if not answered:
                return set()
            present = await conn.execute(self._answered_attempts, {"traces": stored_traces})
            logged = {(trace, call, started) for trace, call, started in present}
        return {key for key in map(_attempt_key, answered) if key not in logged}

    async def _commit_postgres(
        self, records: list[CallRecord], rollouts: list[dict[str, Any]], answered: list[CallRecord]
    ) -> set[_AttemptKey]:
        calls = _json_rows(records)
        touched = _json_rows(rollouts)
        async with self._conn_lock:  # only the writer task commits; tests may call _commit directly
            conn = await self._connection()
            try:
                raw = await conn.get_raw_connection()
                driver: Any = raw.driver_connection  # the asyncpg connection under SQLAlchemy's
                inserted = await driver.fetchval(self._batch_sql, calls, touched)
                if inserted == len(answered):
                    kept_out: set[_AttemptKey] = set()
                else:  # some answered call had its answered row already: which ones (rare)
                    rows = await driver.fetch(
                        _ANSWERED_ATTEMPTS_SQL,
                        [storable(r.trace_id) for r in answered],
                        [storable(r.call_id) for r in answered],
                    )
                    logged = {(row[0], row[1], row[2]) for row in rows}
                    kept_out = {key for key in map(_attempt_key, answered) if key not in logged}
            except BaseException:
                # Whatever went wrong, the next batch starts on a new connection.
                self._conn = None
                await _discard(conn)
                raise
            self._idle_since = time.monotonic()
        return kept_out

    async def _connection(self) -> AsyncConnection:
        """The writer's own autocommit connection; checked first if it sat idle (a restarted database)."""
        conn = self._conn
        if conn is not None and time.monotonic() - self._idle_since > _IDLE_CHECK_SECONDS:
            try:
                await conn.exec_driver_sql("SELECT 1")
            except (DBAPIError, OSError):
                await _discard(conn)
                conn = self._conn = None
        if conn is None:
            conn = await self._engine.connect()
            try:
                await conn.execution_options(isolation_level="AUTOCOMMIT")
            except BaseException:
                await conn.close()
                raise
            self._conn = conn
        return conn

    async def aclose(self) -> None:
        # Drain what is queued before stopping, so nothing answered is lost at shutdown.
        if self._task is not None:
            if not self._task.done():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._queue.join(), timeout=30)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        async with self._conn_lock:
            if self._conn is not None:
                conn, self._conn = self._conn, None
                with contextlib.suppress(Exception):
                    await conn.close()


_IDLE_CHECK_SECONDS = 5.0
_SHORT_TIMEOUT_SECONDS = 5.0  # one try of a correction (`void`, `take_over`)


async def _discard(conn: AsyncConnection) -> None:
    """Drop a connection that failed: invalidate it (never reused) and give it back to the pool."""
    with contextlib.suppress(Exception):
        await conn.invalidate()
    with contextlib.suppress(Exception):
        await conn.close()


def _attempt_key(record: CallRecord) -> _AttemptKey:
    return storable(record.trace_id), storable(record.call_id or ""), record.started_at


def _json_rows(rows: list[CallRecord] | list[dict[str, Any]]) -> str:
    """The rows as one JSON array for json_to_recordset (orjson writes the dataclasses itself).

    Postgres text cannot hold NUL, so a NUL is logged as U+FFFD (output_bytes keeps the size sent).
    orjson escapes NUL as \\u0000; when that text occurs (a NUL, or the six characters themselves),
    the rows are written again, field by field.
    """
    payload = orjson.dumps(rows)
    if b"\\u0000" not in payload:
        return payload.decode()
    return orjson.dumps([_without_nul(row) for row in rows]).decode()


def _without_nul(row: CallRecord | dict[str, Any]) -> dict[str, Any]:
    return storable(asdict(row) if isinstance(row, CallRecord) else dict(row))
