"""Queries of a run's learning curve: its rollouts cut into windows of time or of rollout order.

Each window aggregates in the database (Postgres and SQLite; the dialect branches live here): the
latest score of every rollout (mean, mean square), calls per rollout, environment failures and
rollouts per flag. Rollouts are placed by `first_seen` (when their first call arrived).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, Integer, cast, func, select, true
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from app.db.models import Grade, Rollout, ToolCall
from sparring.wire import ENVIRONMENT_FAILURES

UNIX_EPOCH_JULIAN_DAY = 2440587.5


@dataclass(frozen=True)
class WindowRow:
    index: int  # 0-based
    rollouts: int
    scored: int
    mean: float | None
    mean_square: float | None
    calls_mean: float
    tool_errors: int  # calls of the window's rollouts that crashed or met an outage
    first: datetime  # first_seen of the window's first and last rollouts
    last: datetime


class CurveRepository:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    @property
    def dialect(self) -> str:
        return self.session.get_bind().dialect.name

    def _epoch(self, column: Any) -> ColumnElement[Any]:
        if self.dialect == "postgresql":
            return func.extract("epoch", column)
        return (func.julianday(column) - UNIX_EPOCH_JULIAN_DAY) * 86400.0

    async def span(self, run: str) -> tuple[float, float] | None:
        """Unix times of the run's first and last rollout starts (None: no rollout)."""
        row = (
            await self.session.execute(
                select(
                    func.min(self._epoch(Rollout.first_seen)), func.max(self._epoch(Rollout.first_seen))
                ).where(Rollout.run == run)
            )
        ).one()
        return None if row[0] is None else (float(row[0]), float(row[1]))

    def _windowed(
        self, run: str, grader: str | None, axis: str, windows: int, span: tuple[float, float]
    ) -> Any:
        """(trace_id, window, score, calls, grade_id, first_seen) per rollout of the run."""
        latest = aliased(Grade)
        newest = select(func.max(latest.id)).where(latest.trace_id == Rollout.trace_id)
        if grader is not None:
            newest = newest.where(latest.grader == grader)
        window: Any
        if axis == "order":
            window = func.ntile(windows).over(order_by=(Rollout.first_seen, Rollout.trace_id)) - 1
        else:
            start, end = span
            width = (end - start) / windows or 1.0
            position = (self._epoch(Rollout.first_seen) - start) / width
            if self.dialect == "postgresql":
                window = func.least(cast(func.floor(position), Integer), windows - 1)
            else:  # SQLite: CAST truncates (positions are >= 0) and a two-argument min() is scalar
                window = func.min(cast(position, Integer), windows - 1)
        return (
            select(
                Rollout.trace_id.label("trace_id"),
                window.label("window"),
                Grade.score.label("score"),
                Rollout.calls.label("calls"),
                Grade.id.label("grade_id"),
                Rollout.first_seen.label("first_seen"),
            )
            .outerjoin(Grade, Grade.id == newest.correlate(Rollout).scalar_subquery())
            .where(Rollout.run == run)
            .subquery("windowed")
        )

    async def windows(self, run: str, grader: str | None, axis: str, windows: int) -> list[WindowRow]:
        span = await self.span(run)
        if span is None:
            return []
        w = self._windowed(run, grader, axis, windows, span)
        failures = (
            select(ToolCall.trace_id.label("trace_id"), func.count().label("n"))
            .where(ToolCall.run == run, ToolCall.outcome.in_(ENVIRONMENT_FAILURES))
            .group_by(ToolCall.trace_id)
            .subquery("failures")
        )
        result = await self.session.execute(
            select(
                w.c.window,
                func.count(),
                func.count(w.c.score),
                func.avg(w.c.score),
                func.avg(w.c.score * w.c.score),
                func.avg(w.c.calls * 1.0),
                func.coalesce(func.sum(failures.c.n), 0),
                func.min(w.c.first_seen),
                func.max(w.c.first_seen),
            )
            .select_from(w)
            .outerjoin(failures, failures.c.trace_id == w.c.trace_id)
            .group_by(w.c.window)
            .order_by(w.c.window)
        )
        return [
            WindowRow(
                index=int(r[0]),
                rollouts=int(r[1]),
                scored=int(r[2]),
                mean=None if r[3] is None else float(r[3]),
                mean_square=None if r[4] is None else float(r[4]),
                calls_mean=float(r[5] or 0.0),
                tool_errors=int(r[6] or 0),
                first=_aware(r[7]),
                last=_aware(r[8]),
            )
            for r in result.all()
        ]

    async def flags(
        self, run: str, grader: str | None, axis: str, windows: int
    ) -> list[tuple[int, str, int]]:
        """(window, flag name, rollouts whose latest grade raised it)."""
        span = await self.span(run)
        if span is None:
            return []
        w = self._windowed(run, grader, axis, windows, span)
        if self.dialect == "postgresql":
            element = func.jsonb_array_elements(Grade.flags).table_valued("value", joins_implicitly=True)
            name: Any = element.c.value.op("->>")("name")
        else:
            element = func.json_each(Grade.flags).table_valued("value", joins_implicitly=True)
            name = func.json_extract(element.c.value, "$.name")
        rollouts = func.count(func.distinct(w.c.trace_id))
        result = await self.session.execute(
            select(w.c.window, name, rollouts)
            .select_from(w)
            .join(Grade, Grade.id == w.c.grade_id)
            .join(element, true())
            .group_by(w.c.window, name)
            .order_by(w.c.window, name)
        )
        return [(int(r[0]), str(r[1]), int(r[2])) for r in result.all()]


def _aware(value: Any) -> datetime:
    """min()/max() of a timestamp come back untyped on SQLite: parse, and mark as UTC."""
    moment = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
