"""The call log writer: many requests share one transaction (group commit), each awaits its batch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

import asyncpg
import orjson
from sqlalchemy import bindparam, exists, func, select, update
from sqlalchemy.dialects import sqlite
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.db.call_log import answers_its_call
from app.db.models import LOGGED_CALL_COLUMNS, LOGGED_ROLLOUT_COLUMNS, RolloutRow, ToolCall
from app.db.session import sqlite_pragmas
from app.db.text import storable
from app.errors import ServiceUnavailable
from app.metrics import Metrics
from sparring.wire import ANSWERS

log = logging.getLogger(__name__)


class LogUnavailable(ServiceUnavailable):
    code = "call_log_unavailable"


@dataclass(slots=True)
class CallRecord:
    """One attempt of a tool call, as logged (its own row: see app/db/call_log.py for how it is read)."""

    attempt_id: str
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

    @property
    def answers_its_call(self) -> bool:
        """Whether this attempt may be its call's answer (the rule of app/db/call_log.py)."""
        return self.call_id is not None and self.outcome in ANSWERS


# A failed commit: SQLAlchemy's errors, and the drivers' (each batch goes to asyncpg or sqlite3 directly).
_COMMIT_ERRORS = (SQLAlchemyError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError, sqlite3.Error)

# A queued record, its writer's future (done once its batch is committed, or failed: 503), and whether
# it was the only call in flight when it was queued.
_Pending = tuple[CallRecord, asyncio.Future[None] | None, bool]

# The columns the writer fills (CallRecord's fields, and output_bytes), derived from the ORM tables.
_CALL_COLUMNS, _ROLLOUT_COLUMNS = LOGGED_CALL_COLUMNS, LOGGED_ROLLOUT_COLUMNS
_ANSWERS_SQL = ", ".join(f"'{outcome}'" for outcome in ANSWERS)


def _recordset(param: str, alias: str, columns: tuple[tuple[str, str], ...]) -> str:
    definition = ", ".join(f"{name} {kind}" for name, kind in columns)
    return f"json_to_recordset(CAST({param} AS json)) AS {alias}({definition})"


def _postgres_batch_sql() -> str:
    """A whole batch in one statement: log the attempts, then upsert their rollouts adding the number of
    calls the log as read gained (app/db/call_log.py): every attempt, but an answer of a call that already
    had an answering attempt (in the log, or earlier in the batch) only replaces it.

    The rows travel as two JSON documents ($1 the attempts, $2 their rollouts; one orjson call each)
    rather than an array per column, which the driver would encode value by value, and the statement goes
    to asyncpg directly (prepared once per connection). Together that is a third of the client CPU that
    SQLAlchemy with column arrays took per batch. One statement does the work, in a transaction of its own
    (with `_BATCH_BEGIN`'s plan setting), so the batch is committed atomically; its subqueries read the
    log as it was before it (the batch's own rows are `logged`, in the order of their ids). The earlier
    answer is looked up by a scalar subquery, an index probe per row: as `EXISTS`, Postgres may run it as
    a hashed scan of every answered row while the table has no statistics yet. The probe is bounded by the
    span of the rollout's row as it was (first_seen to last_seen, around every attempt logged for it): on
    a partitioned log (Postgres, app/db/partitions.py) it reads that span's partitions only, not every
    day's; a rollout without a row has no attempt yet. Its row is read by its key for each of the batch's
    rows (a lateral subquery, kept apart from the join by `OFFSET 0`): joined, the planner hashed the
    whole rollouts table for every batch while its statistics said it was small. The rollouts are
    upserted in trace_id order, so two workers' batches lock shared rollouts in the same order.
    """
    names = ", ".join(name for name, _ in _CALL_COLUMNS)
    answers = f"b_.call_id IS NOT NULL AND b_.outcome IN ({_ANSWERS_SQL})"
    return f"""
        WITH logged AS (
            INSERT INTO tool_calls ({names})
            SELECT {names} FROM {_recordset("$1", "c_", _CALL_COLUMNS)}
            RETURNING id, trace_id, call_id, outcome
        ), counted AS (
            SELECT b_.trace_id, count(*) AS n FROM logged b_
            LEFT JOIN LATERAL (
                SELECT first_seen, last_seen FROM rollouts WHERE trace_id = b_.trace_id OFFSET 0
            ) s_ ON true
            WHERE NOT ({answers} AND (
                (SELECT 1 FROM tool_calls t_ WHERE t_.trace_id = b_.trace_id
                 AND t_.call_id = b_.call_id AND t_.outcome IN ({_ANSWERS_SQL})
                 AND t_.started_at >= s_.first_seen AND t_.started_at <= s_.last_seen LIMIT 1) IS NOT NULL
                OR EXISTS (SELECT 1 FROM logged e_ WHERE e_.trace_id = b_.trace_id
                           AND e_.call_id = b_.call_id AND e_.outcome IN ({_ANSWERS_SQL})
                           AND e_.id < b_.id)))
            GROUP BY b_.trace_id
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


# The batch's transaction, with the one plan setting it needs. Postgres keeps a generic plan for the
# batch statement (prepared once per connection) made from its first executions; made while the day's
# partition was empty or had no statistics (a new install, a new day, autovacuum behind or off), that
# plan probed a call's earlier answer by scanning the whole partition, a cost that grew with the log:
# 400 calls/s instead of thousands. Without sequential scans the probe reads the call index, whatever
# the statistics. SET LOCAL ends with the transaction, so a pooled connection (or PgBouncer in
# transaction mode) carries nothing of it to another statement.
_BATCH_BEGIN = "BEGIN; SET LOCAL enable_seqscan = off"


def _calls_gained(rows: list[dict[str, Any]], answered_before: set[tuple[str, str | None]]) -> dict[str, int]:
    """Per rollout, the calls the log as read gains with these rows (what the Postgres statement
    counts): an answer of a call that had an answering attempt only replaces it."""
    gained: dict[str, int] = {}
    answered = set(answered_before)
    for row in rows:
        if row["call_id"] is not None and row["outcome"] in ANSWERS:
            key = (row["trace_id"], row["call_id"])
            if key in answered:
                gained.setdefault(row["trace_id"], 0)
                continue
            answered.add(key)
        gained[row["trace_id"]] = gained.get(row["trace_id"], 0) + 1
    return gained


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
        # SQLite: the batch in one hop to a thread of its own, on a driver connection of its own, its
        # statements compiled once (`_SqliteBatch`).
        self._sqlite: _SqliteBatch | None = None
        self._sqlite_thread: ThreadPoolExecutor | None = None
        if not self._postgres:
            self._sqlite = _SqliteBatch(engine.url.database or ":memory:")
            self._sqlite_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="call-log")

    def queue_depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="call-log-writer")

    async def write(self, record: CallRecord) -> None:
        """Queue the record and wait until it is committed; 503 when the queue is full or the DB fails."""
        await self.enqueue(record)

    def enqueue(self, record: CallRecord, *, alone: bool = False) -> asyncio.Future[None]:
        """Queue the record now; the future is done when its batch is committed (or failed: 503).

        LogUnavailable at once when the queue is full. A caller that still has work to do before it
        answers (storing the answer in the ledger) does it while the batch commits, then awaits.
        `alone`: no other call is in flight in this worker. SQLite then commits a batch of that one
        record on the event loop rather than in the writer's thread (see `_commit`).
        """
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait((record, future, alone))
        except asyncio.QueueFull:
            raise LogUnavailable(
                "call log is saturated; retry shortly", retry_after=self._retry_after
            ) from None
        return future

    async def void(self, record: CallRecord, *, reason: str, status_code: int = 503) -> None:
        """Turn the logged answer of `record`'s attempt into the failure it became: the answer was
        logged while the store was keeping it, keeping it failed, and the caller got `status_code`.

        One UPDATE of the attempt's own row (found by its rollout, start and attempt id): it stays
        as that attempt's infra_error, without the output, so it never reads as its call's answer.
        A row that was never committed (or is voided already) matches nothing. The failure is a call
        of its own in the log as read, and the call's answer one only while an answering attempt
        remains: the rollout's count gains one when one does. Tried up to three times;
        LogUnavailable if it never went in.
        """
        trace_id = storable(record.trace_id)
        statement = (
            update(ToolCall)
            .where(
                ToolCall.trace_id == trace_id,
                ToolCall.started_at == record.started_at,
                ToolCall.attempt_id == record.attempt_id,
                answers_its_call(),
            )
            .values(
                outcome="infra_error",
                status_code=status_code,
                error=storable(reason),
                output=None,
                output_bytes=0,
            )
            .returning(ToolCall.call_id)
        )
        answered = exists().where(
            ToolCall.trace_id == trace_id, ToolCall.call_id == bindparam("call_id"), answers_its_call()
        )
        counted = (
            update(RolloutRow)
            .where(RolloutRow.trace_id == trace_id, answered)
            .values(calls=RolloutRow.calls + 1)
        )
        failure: BaseException | None = None
        for attempt in range(3):
            try:
                async with asyncio.timeout(_VOID_TIMEOUT_SECONDS):
                    async with self._engine.begin() as conn:
                        voided = (await conn.execute(statement)).first()
                        if voided is not None:
                            await conn.execute(counted, {"call_id": voided.call_id})
                return
            except (*_COMMIT_ERRORS, TimeoutError) as exc:
                failure = exc
                log.warning("call log: a void failed (attempt %d of 3): %s", attempt + 1, exc)
                await asyncio.sleep(0.05 * 4**attempt)
        raise LogUnavailable("call log database unreachable", retry_after=self._retry_after) from failure

    def submit(self, record: CallRecord) -> None:
        """Best effort, without waiting (used for calls that already failed with a 503)."""
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait((record, None, False))

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
            lone = len(batch) == 1 and batch[0][2] and self._queue.empty()
            try:
                await self._commit([record for record, _, _ in batch], on_loop=lone)
            except asyncio.CancelledError:
                for _, future, _ in batch:
                    if future is not None and not future.done():
                        future.set_exception(
                            LogUnavailable("server shutting down", retry_after=self._retry_after)
                        )
                raise
            except _COMMIT_ERRORS as exc:
                log.warning("call log commit failed for %d calls: %s", len(batch), exc)
                error = LogUnavailable("call log database unreachable", retry_after=self._retry_after)
                for _, future, _ in batch:
                    if future is not None and not future.done():
                        future.set_exception(error)
            except Exception:  # a bug must not kill the writer task
                log.exception("call log commit failed")
                for _, future, _ in batch:
                    if future is not None and not future.done():
                        future.set_exception(LogUnavailable("call log failed", retry_after=self._retry_after))
            else:
                for _, future, _ in batch:
                    if future is not None and not future.done():
                        future.set_result(None)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _commit(self, records: list[CallRecord], *, on_loop: bool = False) -> None:
        """Log the records, each in its own row, and count the calls their rollouts gain.

        SQLite commits in the writer's thread, so the event loop goes on answering other calls while the
        commit waits for the disk, and those calls' records make the next batch. With `on_loop` (a batch
        of one call, queued while no other was in flight) it commits on the event loop: nobody waits
        for the loop meanwhile, and the call saves the two thread hand-offs (each wakes an idle core:
        0.3-0.5 ms of a call's time on the machine of bench/README.md). A call that arrives during that
        commit waits for it, at most the one commit.
        """
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
        answers = any(record.answers_its_call for record in records)
        batch = self._sqlite
        assert batch is not None
        if on_loop and batch.commit(rows, rollout_rows, answers, wait=False):
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._sqlite_thread, batch.commit, rows, rollout_rows, answers)

    async def _commit_postgres(self, records: list[CallRecord], rollouts: list[dict[str, Any]]) -> None:
        calls = _json_rows(records)
        touched = _json_rows(rollouts)
        async with self._conn_lock:  # only the writer task commits; tests may call _commit directly
            # Bounded: a database that stops answering without closing the connection (a partition, a
            # failover) would hold every call's answer; a TimeoutError is an outage (503) like any other.
            async with asyncio.timeout(COMMIT_TIMEOUT_SECONDS):
                conn = await self._connection()
                try:
                    raw = await conn.get_raw_connection()
                    driver: Any = raw.driver_connection  # the asyncpg connection under SQLAlchemy's
                    await driver.execute(_BATCH_BEGIN)
                    await driver.execute(self._batch_sql, calls, touched)
                    await driver.execute("COMMIT")
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
        if self._sqlite_thread is not None:
            thread, self._sqlite_thread = self._sqlite_thread, None
            await asyncio.to_thread(thread.shutdown, wait=True)  # a batch still committing ends first
        if self._sqlite is not None:
            self._sqlite.close()


_IDLE_CHECK_SECONDS = 5.0
_VOID_TIMEOUT_SECONDS = 5.0  # one try of a void
COMMIT_TIMEOUT_SECONDS = 15.0  # one Postgres batch, its connection included (a commit takes milliseconds)


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


# A record's fields are text, numbers and datetimes: read as they are, not deep-copied (as `asdict` does).
_RECORD_FIELDS = tuple(f.name for f in fields(CallRecord))


def _without_nul(row: CallRecord | dict[str, Any]) -> dict[str, Any]:
    if not isinstance(row, CallRecord):
        return storable(dict(row))
    return {name: storable(getattr(row, name)) for name in _RECORD_FIELDS}  # flat: no walk below a field


_Rows = list[dict[str, Any]]


class _SqliteBatch:
    """The SQLite batch as the driver runs it: the statements SQLAlchemy builds, compiled once to SQL,
    sent to `sqlite3` directly on a connection of the writer's own (through SQLAlchemy's engine, a batch
    of one call after an idle moment spent 0.9 ms in its statements before the commit; 0.3 ms this way).

    Values go through the columns' own bind processors (SQLite's DATETIME text), so the rows are the
    ones SQLAlchemy wrote. The connection is opened on first use and opened again after a failure.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._conns: dict[bool, sqlite3.Connection] = {}  # by whether it waits for the write lock
        self._lock = threading.Lock()  # one batch at a time, whichever thread runs it
        dialect = sqlite.dialect(paramstyle="named")
        calls, rollouts = ToolCall.__table__, RolloutRow.__table__
        call_names = [name for name, _ in _CALL_COLUMNS]
        rollout_names = [name for name, _ in _ROLLOUT_COLUMNS] + ["calls"]
        insert: Any = sqlite.insert
        upsert = insert(rollouts)
        upsert = upsert.on_conflict_do_update(
            index_elements=[rollouts.c.trace_id],
            set_={
                "first_seen": func.min(rollouts.c.first_seen, upsert.excluded.first_seen),
                "last_seen": func.max(rollouts.c.last_seen, upsert.excluded.last_seen),
                "run": func.coalesce(rollouts.c.run, upsert.excluded.run),
                "item_key": func.coalesce(rollouts.c.item_key, upsert.excluded.item_key),
                "channel": func.coalesce(rollouts.c.channel, upsert.excluded.channel),
                "calls": rollouts.c.calls + upsert.excluded.calls,
            },
        )
        self._upsert = upsert.compile(dialect=dialect, column_keys=rollout_names).string
        self._insert = insert(calls).compile(dialect=dialect, column_keys=call_names).string
        # Whether one call of the batch had an answering attempt already: an index probe
        # (ix_tool_calls_trace_call), whatever the number of calls its rollout has logged.
        answered = (
            select(ToolCall.call_id)
            .where(
                ToolCall.trace_id == bindparam("trace_", value=""),
                ToolCall.call_id == bindparam("call_", value=""),
                answers_its_call(),
            )
            .limit(1)
            .compile(dialect=dialect, compile_kwargs={"render_postcompile": True})
        )
        self._answered, self._answered_params = answered.string, dict(answered.params)
        self._call_processors = _processors(calls, call_names, dialect)
        self._rollout_processors = _processors(rollouts, rollout_names, dialect)

    def commit(
        self,
        rows: list[dict[str, Any]],
        rollout_rows: list[dict[str, Any]],
        answers: bool,
        *,
        wait: bool = True,
    ) -> bool:
        """Log the rows and count their rollouts' calls: one transaction, committed before it returns.

        Without `wait` (on the event loop), False at once when another connection holds the database's
        write lock (a retention sweep, a CLI): waiting for it there would stall every call, and the
        holder itself when it needs the loop to finish. Nothing was written then.
        """
        with self._lock:
            conn = self._connect(wait)
            try:
                try:
                    conn.execute("BEGIN IMMEDIATE")  # the reads below see what no other writer changes
                except sqlite3.OperationalError as exc:
                    if not wait and exc.sqlite_errorcode == sqlite3.SQLITE_BUSY:
                        return False
                    raise
                answered: set[tuple[str, str | None]] = set()
                if answers:  # the calls this batch answers: which of them had an answer before
                    calls = {
                        (row["trace_id"], row["call_id"])
                        for row in rows
                        if row["call_id"] is not None and row["outcome"] in ANSWERS
                    }
                    for trace, call in sorted(calls):
                        params = {**self._answered_params, "trace_": trace, "call_": call}
                        if conn.execute(self._answered, params).fetchone() is not None:
                            answered.add((trace, call))
                gained = _calls_gained(rows, answered)
                for row in rollout_rows:
                    row["calls"] = gained.get(row["trace_id"], 0)
                conn.executemany(
                    self._upsert, [_processed(row, self._rollout_processors) for row in rollout_rows]
                )
                conn.executemany(self._insert, [_processed(row, self._call_processors) for row in rows])
                conn.execute("COMMIT")
            except BaseException:
                self.close_locked()  # the next batch starts on new connections (a rollback with them)
                raise
        return True

    def _connect(self, wait: bool) -> sqlite3.Connection:
        """The connection that waits for another's write lock (its busy timeout), or the one that does not
        (busy timeout 0): two connections rather than a PRAGMA each way around every batch."""
        conn = self._conns.get(wait)
        if conn is None:
            conn = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
            try:
                sqlite_pragmas(conn, None)
                if not wait:
                    conn.execute("PRAGMA busy_timeout=0")
            except BaseException:
                conn.close()
                raise
            self._conns[wait] = conn
        return conn

    def close_locked(self) -> None:
        conns, self._conns = self._conns, {}
        for conn in conns.values():
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    def close(self) -> None:
        with self._lock:
            self.close_locked()


def _processors(table: Any, names: list[str], dialect: Any) -> list[tuple[str, Any]]:
    """The columns among `names` whose values the driver takes converted (SQLite's DATETIME text)."""
    found = []
    for name in names:
        processor = table.c[name].type.dialect_impl(dialect).bind_processor(dialect)
        if processor is not None:
            found.append((name, processor))
    return found


def _processed(row: dict[str, Any], processors: list[tuple[str, Any]]) -> dict[str, Any]:
    for name, processor in processors:
        row[name] = processor(row[name])
    return row
