"""The call log writer: many requests share one transaction (group commit), each awaits its batch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

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
        # Built once: the same statements each batch, so SQLAlchemy compiles them once.
        insert: Any = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        greatest = func.greatest if engine.dialect.name == "postgresql" else func.max
        least = func.least if engine.dialect.name == "postgresql" else func.min
        rollouts = Rollout.__table__
        upsert = insert(rollouts)
        self._rollout_upsert = upsert.on_conflict_do_update(
            index_elements=[rollouts.c.trace_id],
            set_={
                "first_seen": least(rollouts.c.first_seen, upsert.excluded.first_seen),
                "last_seen": greatest(rollouts.c.last_seen, upsert.excluded.last_seen),
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
        # Rows in a fixed order, so two workers upserting the same rollouts cannot deadlock.
        rows = [
            {**asdict(record), "output_bytes": len(record.output.encode()) if record.output else 0}
            for record in records
        ]
        traces = sorted(rollouts)
        async with self._engine.begin() as conn:
            # The upsert locks each rollout row first, so concurrent batches of one rollout take turns
            # and each recount sees the calls the other committed.
            await conn.execute(self._rollout_upsert, [rollouts[key] for key in traces])
            await conn.execute(self._calls_insert, rows)
            await conn.execute(self._recount, {"traces": traces})

    async def aclose(self) -> None:
        # Drain what is queued before stopping, so nothing answered is lost at shutdown.
        if self._task is None:
            return
        if not self._task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue.join(), timeout=30)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
