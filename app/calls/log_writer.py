"""The call log writer: many requests share one transaction (group commit), each awaits its batch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
import orjson
from sqlalchemy import bindparam, func, select, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db.models import Rollout, ToolCall
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

_Pending = tuple[CallRecord, asyncio.Future[None] | None]

# The columns of tool_calls the writer fills, in the order of CallRecord's fields plus output_bytes.
_CALL_COLUMNS = (
    ("trace_id", "varchar"),
    ("call_id", "varchar"),
    ("request_id", "varchar"),
    ("tool", "varchar"),
    ("arguments", "text"),
    ("output", "text"),
    ("outcome", "varchar"),
    ("error", "text"),
    ("status_code", "integer"),
    ("started_at", "timestamptz"),
    ("ended_at", "timestamptz"),
    ("latency_ms", "float8"),
    ("worker", "varchar"),
    ("run", "varchar"),
    ("item_key", "varchar"),
    ("channel", "varchar"),
    ("output_bytes", "integer"),
)
_ROLLOUT_COLUMNS = (
    ("trace_id", "varchar"),
    ("run", "varchar"),
    ("item_key", "varchar"),
    ("channel", "varchar"),
    ("first_seen", "timestamptz"),
    ("last_seen", "timestamptz"),
)


def _recordset(param: str, alias: str, columns: tuple[tuple[str, str], ...]) -> str:
    definition = ", ".join(f"{name} {kind}" for name, kind in columns)
    return f"json_to_recordset(CAST({param} AS json)) AS {alias}({definition})"


def _postgres_batch_sql() -> str:
    """A whole batch in one statement: log the calls, then upsert their rollouts adding the number of
    calls actually inserted (a call answered before, replayed from the ledger, conflicts on
    uq_tool_calls_answered and is neither logged nor counted twice).

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
            RETURNING trace_id
        ), counted AS (
            SELECT trace_id, count(*) AS n FROM logged GROUP BY trace_id
        )
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
        rollouts = Rollout.__table__
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
        self._recount = (
            update(Rollout)
            .where(Rollout.trace_id.in_(bindparam("traces", expanding=True)))
            .values(
                calls=select(func.count())
                .select_from(calls)
                .where(calls.c.trace_id == Rollout.trace_id)
                .scalar_subquery()
            )
        )

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="call-log-writer")

    async def write(self, record: CallRecord) -> None:
        """Queue the record and wait until it is committed; 503 when the queue is full or the DB fails."""
        await self.enqueue(record)

    def enqueue(self, record: CallRecord) -> asyncio.Future[None]:
        """Queue the record now; the future is done when its batch is committed (or failed: 503).

        LogUnavailable at once when the queue is full. A caller that still has work to do before it
        answers (storing the answer in the ledger) does it while the batch commits, then awaits.
        """
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait((record, future))
        except asyncio.QueueFull:
            raise LogUnavailable(
                "call log is saturated; retry shortly", retry_after=self._retry_after
            ) from None
        return future

    async def void(self, record: CallRecord, reason: str) -> None:
        """Turn the logged answer of `record` into the infra_error it became: the answer was logged
        while its state was being stored, storing it failed, and the caller got a 503 instead.

        The row stays (a logged attempt, counted like any other) but no longer says what was never
        sent: outcome infra_error, status 503, no output. It leaves the answered-calls unique index, so
        the retry's answer is logged in its own row. Matched by the attempt's own trace, call,
        worker and start time; a row that was never committed matches nothing.
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
                ToolCall.outcome.in_(("ok", "model_error")),
            )
            .values(
                outcome="infra_error", status_code=503, error=storable(reason), output=None, output_bytes=0
            )
        )
        try:
            async with self._engine.begin() as conn:
                await conn.execute(statement)
        except _COMMIT_ERRORS as exc:
            log.error(
                "call log: the answer to call %s of rollout %s was logged but not sent, and could not "
                "be marked so: %s",
                record.call_id,
                record.trace_id,
                exc,
            )

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
                await self._commit([record for record, _ in batch])
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
                for _, future in batch:
                    if future is not None and not future.done():
                        future.set_result(None)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _commit(self, records: list[CallRecord]) -> None:
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
        if self._postgres:
            await self._commit_postgres(records, [rollouts[key] for key in traces])
            return
        rows = [_without_nul(record) for record in records]
        rollout_rows = [storable(rollouts[key]) for key in traces]
        async with self._engine.begin() as conn:
            # The upsert locks each rollout row first, so concurrent batches of one rollout take turns
            # and each recount sees the calls the other committed.
            await conn.execute(self._rollout_upsert, rollout_rows)
            await conn.execute(self._calls_insert, rows)
            await conn.execute(self._recount, {"traces": [row["trace_id"] for row in rollout_rows]})

    async def _commit_postgres(self, records: list[CallRecord], rollouts: list[dict[str, Any]]) -> None:
        calls = _json_rows(records)
        touched = _json_rows(rollouts)
        async with self._conn_lock:  # only the writer task commits; tests may call _commit directly
            conn = await self._connection()
            try:
                raw = await conn.get_raw_connection()
                driver: Any = raw.driver_connection  # the asyncpg connection under SQLAlchemy's
                await driver.execute(self._batch_sql, calls, touched)
            except BaseException:
                # Whatever went wrong, the next batch starts on a new connection.
                self._conn = None
                await _discard(conn)
                raise
            self._idle_since = time.monotonic()

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


async def _discard(conn: AsyncConnection) -> None:
    """Drop a connection that failed: invalidate it (never reused) and give it back to the pool."""
    with contextlib.suppress(Exception):
        await conn.invalidate()
    with contextlib.suppress(Exception):
        await conn.close()


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
