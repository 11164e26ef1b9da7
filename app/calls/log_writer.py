"""The call log writer: many requests share one transaction (group commit), each awaits its batch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import TextClause, bindparam, func, select, text, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db.models import Rollout, ToolCall
from app.errors import ServiceUnavailable
from app.metrics import Metrics

log = logging.getLogger(__name__)


class LogUnavailable(ServiceUnavailable):
    code = "call_log_unavailable"


@dataclass(frozen=True)
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
    ("output_bytes", "integer"),
)
_ROLLOUT_COLUMNS = (
    ("trace_id", "varchar"),
    ("run", "varchar"),
    ("item_key", "varchar"),
    ("first_seen", "timestamptz"),
    ("last_seen", "timestamptz"),
)


def _unnest(prefix: str, columns: tuple[tuple[str, str], ...]) -> str:
    arrays = ", ".join(f"CAST(:{prefix}{name} AS {kind}[])" for name, kind in columns)
    return f"unnest({arrays}) AS {prefix}({', '.join(name for name, _ in columns)})"


def _postgres_batch_statement() -> TextClause:
    """A whole batch in one statement, each column sent as one array: log the calls, then upsert their
    rollouts adding the number of calls actually inserted (a call answered before, replayed from the
    ledger, conflicts on uq_tool_calls_answered and is neither logged nor counted twice).

    One statement is one transaction, so the batch is committed atomically in one round trip. Running
    it again after an unknown outcome cannot count a call twice either. The rollouts are upserted in
    trace_id order, so two workers' batches lock shared rollouts in the same order.
    """
    names = ", ".join(name for name, _ in _CALL_COLUMNS)
    return text(
        f"""
        WITH logged AS (
            INSERT INTO tool_calls ({names})
            SELECT {names} FROM {_unnest("c_", _CALL_COLUMNS)}
            ON CONFLICT DO NOTHING
            RETURNING trace_id
        ), counted AS (
            SELECT trace_id, count(*) AS n FROM logged GROUP BY trace_id
        )
        INSERT INTO rollouts (trace_id, run, item_key, first_seen, last_seen, calls)
        SELECT r_.trace_id, r_.run, r_.item_key, r_.first_seen, r_.last_seen, coalesce(counted.n, 0)
        FROM {_unnest("r_", _ROLLOUT_COLUMNS)}
        LEFT JOIN counted ON counted.trace_id = r_.trace_id
        ORDER BY r_.trace_id
        ON CONFLICT (trace_id) DO UPDATE SET
            first_seen = least(rollouts.first_seen, excluded.first_seen),
            last_seen = greatest(rollouts.last_seen, excluded.last_seen),
            run = coalesce(rollouts.run, excluded.run),
            item_key = coalesce(rollouts.item_key, excluded.item_key),
            calls = rollouts.calls + excluded.calls
        """
    )


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
        self._batch_statement = _postgres_batch_statement() if self._postgres else None
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
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait((record, future))
        except asyncio.QueueFull:
            raise LogUnavailable(
                "call log is saturated; retry shortly", retry_after=self._retry_after
            ) from None
        await future

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
            except (SQLAlchemyError, OSError) as exc:
                log.warning("call log commit failed for %d calls: %s", len(batch), exc)
                error = LogUnavailable(
                    f"call log database unreachable: {type(exc).__name__}", retry_after=self._retry_after
                )
                for _, future in batch:
                    if future is not None and not future.done():
                        future.set_exception(error)
            except Exception as exc:  # a bug must not kill the writer task
                log.exception("call log commit failed")
                for _, future in batch:
                    if future is not None and not future.done():
                        future.set_exception(
                            LogUnavailable(f"call log failed: {exc}", retry_after=self._retry_after)
                        )
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
        rows = [{**asdict(record), "output_bytes": _output_bytes(record)} for record in records]
        async with self._engine.begin() as conn:
            # The upsert locks each rollout row first, so concurrent batches of one rollout take turns
            # and each recount sees the calls the other committed.
            await conn.execute(self._rollout_upsert, [rollouts[key] for key in traces])
            await conn.execute(self._calls_insert, rows)
            await conn.execute(self._recount, {"traces": traces})

    async def _commit_postgres(self, records: list[CallRecord], rollouts: list[dict[str, Any]]) -> None:
        assert self._batch_statement is not None
        columns = list(zip(*(_record_values(record) for record in records), strict=True))
        params: dict[str, Any] = {
            f"c_{name}": list(values) for (name, _), values in zip(_CALL_COLUMNS, columns, strict=True)
        }
        for name, _ in _ROLLOUT_COLUMNS:
            params[f"r_{name}"] = [row[name] for row in rollouts]
        async with self._conn_lock:  # only the writer task commits; tests may call _commit directly
            conn = await self._connection()
            try:
                await conn.execute(self._batch_statement, params)
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


def _output_bytes(record: CallRecord) -> int:
    return len(record.output.encode()) if record.output else 0


def _record_values(record: CallRecord) -> tuple[Any, ...]:
    """The record's values in _CALL_COLUMNS order."""
    return (
        record.trace_id,
        record.call_id,
        record.request_id,
        record.tool,
        record.arguments,
        record.output,
        record.outcome,
        record.error,
        record.status_code,
        record.started_at,
        record.ended_at,
        record.latency_ms,
        record.worker,
        record.run,
        record.item_key,
        _output_bytes(record),
    )
