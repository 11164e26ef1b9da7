"""A run's statistics, aggregated in SQL: rewards, calls and latencies, items, flags, the learning curve.

Portable across Postgres and SQLite; the few places that differ (JSON arrays, percentiles, byte
lengths) branch on the dialect here and nowhere else. Aggregates run in SQL: a run's statistics read
its calls once per query instead of shipping a million rows to Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Float,
    Integer,
    and_,
    case,
    cast,
    func,
    literal,
    select,
    text,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from app.db.call_log import stands
from app.db.models import Grade, RolloutRow, ToolCall
from sparring.wire import ENVIRONMENT_FAILURES

QUANTILES = (0.5, 0.9, 0.99)
OUTCOMES = ("ok", "model_error", "tool_crash", "infra_error", "call_id_reused")


@dataclass(frozen=True)
class RewardSummary:
    rollouts: int
    graded: int
    failed: int
    scored: int
    mean: float | None
    mean_square: float | None
    min: float | None
    max: float | None
    edges: list[float]
    counts: list[int]


@dataclass(frozen=True)
class ToolRow:
    tool: str | None  # None: the whole run
    calls: int
    latency_mean_ms: float
    latency_max_ms: float
    outcomes: dict[str, int]
    percentiles: list[float] | None  # at QUANTILES
    output_bytes: int


@dataclass(frozen=True)
class ItemRow:
    item_key: str | None
    rollouts: int
    mean: float
    mean_square: float
    min: float
    max: float


@dataclass(frozen=True)
class ItemSummary:
    items: int
    repeated_items: int  # items with at least `min_rollouts` scored rollouts
    always_zero: int
    always_one: int


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


class Queries:
    """Queries on one session, branching on its dialect where Postgres and SQLite differ."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    @property
    def dialect(self) -> str:
        return self.session.get_bind().dialect.name

    def _epoch(self, column: Any) -> ColumnElement[Any]:
        """A timestamp column as Unix seconds, to the microsecond."""
        if self.dialect == "postgresql":
            return func.extract("epoch", column)
        # SQLite stores "YYYY-MM-DD HH:MM:SS.ffffff": the whole seconds of its first 19 characters, then
        # the fraction as written. (julianday() keeps milliseconds only, and strftime() of the whole text
        # rounds .9995 and later up to the next second, the fraction then counted twice.)
        seconds = cast(func.strftime("%s", func.substr(column, 1, 19)), Float)
        return seconds + cast(func.substr(column, 20), Float)


class StatsRepository(Queries):
    """Every query of a run's statistics and of its learning curve."""

    async def prepare_for_aggregates(self) -> None:
        """Tune this transaction for one-off scans of a whole run (Postgres; reset at commit/rollback).

        JIT compiling costs ~1 s on these plans (the planner overestimates set-returning JSON
        functions) and saves nothing; 32 MB keeps the per-rollout hash aggregates in memory.
        """
        if self.dialect == "postgresql":
            await self.session.execute(text("SET LOCAL jit = off"))
            await self.session.execute(text("SET LOCAL work_mem = '32MB'"))

    # --- a run: rewards --------------------------------------------------------------------------------

    def _latest_grades(self, run: str | None, grader: str | None) -> Any:
        """(trace_id, item_key of the rollout, grade_id of its latest grade) per graded rollout of the run."""
        query = (
            select(
                Grade.trace_id.label("trace_id"),
                RolloutRow.item_key.label("item_key"),
                func.max(Grade.id).label("grade_id"),
            )
            .join(RolloutRow, RolloutRow.trace_id == Grade.trace_id)
            .group_by(Grade.trace_id, RolloutRow.item_key)  # trace_id is the rollout's key: one group each
        )
        if run is not None:
            query = query.where(RolloutRow.run == run)
        if grader is not None:
            query = query.where(Grade.grader == grader)
        return query.subquery("latest")

    async def channels(self, run: str) -> dict[str, int]:
        """The run's rollouts per channel."""
        result = await self.session.execute(
            select(RolloutRow.channel, func.count()).where(RolloutRow.run == run).group_by(RolloutRow.channel)
        )
        return {(kind or "rft"): int(count) for kind, count in result.all()}

    async def rollout_count(self, run: str) -> int:
        return int(await self.session.scalar(select(func.count()).where(RolloutRow.run == run)) or 0)

    async def reward_distribution(self, run: str, grader: str | None, bins: int) -> RewardSummary:
        """Latest scores of the run's rollouts: totals and a histogram, in one pass over the grades.

        Bins split [0, 1]; when some score falls outside, a second pass bins [min, max] instead.
        """
        score = Grade.score
        bucket = case(
            (score.is_(None), None),
            (score < 0, -1),
            (score > 1, bins),
            *((score < (i + 1) / bins, i) for i in range(bins - 1)),
            else_=bins - 1,
        )
        latest = self._latest_grades(run, grader)
        result = await self.session.execute(
            select(
                bucket,
                func.count(),
                func.sum(case((Grade.status == "failed", 1), else_=0)),
                func.count(score),
                func.sum(score),
                func.sum(score * score),
                func.min(score),
                func.max(score),
            )
            .join_from(latest, Grade, Grade.id == latest.c.grade_id)
            .group_by(bucket)
        )
        rows = result.all()
        graded = sum(int(r[1]) for r in rows)
        scored = sum(int(r[3]) for r in rows)
        total = sum(float(r[4] or 0.0) for r in rows)
        squares = sum(float(r[5] or 0.0) for r in rows)
        lows = [float(r[6]) for r in rows if r[6] is not None]
        highs = [float(r[7]) for r in rows if r[7] is not None]
        lo, hi = min(lows, default=0.0), max(highs, default=1.0)
        edges = [i / bins for i in range(bins + 1)]
        counts = [0] * bins
        for r in rows:
            if r[0] is not None and 0 <= int(r[0]) < bins:
                counts[int(r[0])] = int(r[3])
        if lo < 0 or hi > 1:
            edges = [min(0.0, lo) + (max(1.0, hi) - min(0.0, lo)) * i / bins for i in range(bins + 1)]
            counts = await self.reward_histogram(run, grader, edges)
        return RewardSummary(
            rollouts=await self.rollout_count(run),
            graded=graded,
            failed=sum(int(r[2] or 0) for r in rows),
            scored=scored,
            mean=total / scored if scored else None,
            mean_square=squares / scored if scored else None,
            min=min(lows) if lows else None,
            max=max(highs) if highs else None,
            edges=edges,
            counts=counts,
        )

    async def reward_histogram(self, run: str, grader: str | None, edges: Sequence[float]) -> list[int]:
        """Counts of latest scores per bin [edges[i], edges[i+1]); the last bin includes its top edge."""
        bins = len(edges) - 1
        bucket = case(*((Grade.score < edges[i + 1], i) for i in range(bins - 1)), else_=bins - 1)
        latest = self._latest_grades(run, grader)
        result = await self.session.execute(
            select(bucket, func.count())
            .join_from(latest, Grade, Grade.id == latest.c.grade_id)
            .where(Grade.score.is_not(None))
            .group_by(bucket)
        )
        counts = [0] * bins
        for index, count in result.all():
            counts[int(index)] = int(count)
        return counts

    # --- a run: calls ----------------------------------------------------------------------------------
    # Calls count for a run by their own label (tool_calls.run, from each call's X-Sparring-Run header),
    # as read (app/db/call_log.py: a replay or an answer given again is not another call).

    def _call_columns(self) -> list[Any]:
        return [
            func.count(),
            func.avg(ToolCall.latency_ms),
            func.max(ToolCall.latency_ms),
            *(func.sum(case((ToolCall.outcome == outcome, 1), else_=0)) for outcome in OUTCOMES),
            func.coalesce(func.sum(ToolCall.output_bytes), 0),
        ]

    @staticmethod
    def _call_row(tool: str | None, r: Sequence[Any], quantiles: Sequence[float] | None) -> ToolRow:
        return ToolRow(
            tool=tool,
            calls=int(r[0]),
            latency_mean_ms=float(r[1] or 0.0),
            latency_max_ms=float(r[2] or 0.0),
            outcomes={outcome: int(r[3 + i] or 0) for i, outcome in enumerate(OUTCOMES)},
            percentiles=[float(q) for q in quantiles] if quantiles else None,
            output_bytes=int(r[3 + len(OUTCOMES)] or 0),
        )

    async def _read(self, run: str) -> ColumnElement[bool]:
        """The run's calls as read (app/db/call_log.py), bounded by their own span of starts: on a
        partitioned log (Postgres) the scan and each call's look-up of a better answer then read the
        partitions of the run's days only, not every day's. The span comes from the index on run
        (its INCLUDE holds started_at on Postgres). A call's retries carry its run label (they are
        the same request again), so its better answer lies within the span too.
        """
        # count() beside min/max keeps the planner from answering them by walking another index.
        first, last, _ = (
            await self.session.execute(
                select(func.min(ToolCall.started_at), func.max(ToolCall.started_at), func.count()).where(
                    ToolCall.run == run
                )
            )
        ).one()
        if first is None:
            return and_(ToolCall.run == run, stands())
        return and_(
            ToolCall.run == run,
            ToolCall.started_at >= first,
            ToolCall.started_at <= last,
            stands(since=first, until=last),
        )

    async def call_stats(self, run: str) -> tuple[list[ToolRow], ToolRow]:
        """Per tool and over the whole run: counts, latency mean/max/percentiles, outcomes, output bytes."""
        read = await self._read(run)
        if self.dialect == "postgresql":
            # One pass: per tool and overall (GROUPING SETS), percentiles as ordered-set aggregates.
            percentiles = func.percentile_disc(
                cast(literal(list(QUANTILES), ARRAY(Float)), ARRAY(Float))
            ).within_group(ToolCall.latency_ms)
            columns = [ToolCall.tool, func.grouping(ToolCall.tool), *self._call_columns(), percentiles]
            result = await self.session.execute(
                select(*columns).where(read).group_by(func.grouping_sets(ToolCall.tool, text("()")))
            )
            at_percentiles = 2 + 4 + len(OUTCOMES)  # after tool, grouping, count, avg, max, outcomes, bytes
            tools: list[ToolRow] = []
            overall = self._call_row(None, [0, None, None, *([0] * len(OUTCOMES)), 0], None)
            for r in result.all():
                row = self._call_row(r[0], r[2:], r[at_percentiles])
                if r[1]:
                    overall = replace(row, tool=None)
                else:
                    tools.append(row)
            tools.sort(key=lambda t: (-t.calls, t.tool or ""))
            return tools, overall
        # SQLite (the embedded default, small data): plain aggregates, then ranked percentiles.
        per_tool = await self.session.execute(
            select(ToolCall.tool, *self._call_columns())
            .where(read)
            .group_by(ToolCall.tool)
            .order_by(func.count().desc(), ToolCall.tool)
        )
        totals = (await self.session.execute(select(*self._call_columns()).where(read))).one()
        ranks = await self._ranked_percentiles(run, per_tool=True)
        overall_ranks = (await self._ranked_percentiles(run, per_tool=False)).get(None)
        tools = [self._call_row(r[0], r[1:], ranks.get(r[0])) for r in per_tool.all()]
        overall = self._call_row(None, totals, overall_ranks)
        return tools, overall

    async def _ranked_percentiles(self, run: str, *, per_tool: bool) -> dict[str | None, list[float]]:
        """Nearest-rank percentiles without a percentile aggregate: rank, then pick rank ceil(q * n)."""
        partition = [ToolCall.tool] if per_tool else []
        read = await self._read(run)
        ranked = (
            select(
                ToolCall.tool.label("tool"),
                ToolCall.latency_ms.label("latency"),
                func.row_number().over(partition_by=partition, order_by=ToolCall.latency_ms).label("rank"),
                func.count().over(partition_by=partition).label("n"),
            )
            .where(read)
            .subquery()
        )
        picks = [
            func.max(
                case(
                    (ranked.c.rank == (ranked.c.n * int(q * 100) + 99) // 100, ranked.c.latency),
                    else_=None,
                )
            )
            for q in QUANTILES
        ]
        query = select(ranked.c.tool if per_tool else literal(None), *picks)
        if per_tool:
            query = query.group_by(ranked.c.tool)
        result = await self.session.execute(query)
        return {r[0]: [float(v) for v in r[1:]] for r in result.all() if r[1] is not None}

    async def calls_per_rollout(self, run: str) -> list[tuple[int, int]]:
        """(number of calls, number of rollouts with that many calls), zero-call rollouts included."""
        # rollouts.calls counts the calls as read (app/db/call_log.py), kept by the log writer.
        result = await self.session.execute(
            select(RolloutRow.calls, func.count())
            .where(RolloutRow.run == run)
            .group_by(RolloutRow.calls)
            .order_by(RolloutRow.calls)
        )
        return [(int(n), int(count)) for n, count in result.all()]

    # --- a run: items ----------------------------------------------------------------------------------

    def _item_scores(self, run: str, grader: str | None) -> Any:
        latest = self._latest_grades(run, grader)
        item = func.coalesce(Grade.item_key, latest.c.item_key)
        return (
            select(
                item.label("item_key"),
                func.count().label("n"),
                func.avg(Grade.score).label("mean"),
                func.avg(Grade.score * Grade.score).label("mean_square"),
                func.min(Grade.score).label("lo"),
                func.max(Grade.score).label("hi"),
            )
            .join_from(latest, Grade, Grade.id == latest.c.grade_id)
            .where(Grade.score.is_not(None))
            .group_by(item)
        )

    async def item_stats(
        self, run: str, grader: str | None, *, order: str, limit: int, offset: int
    ) -> list[ItemRow]:
        items = self._item_scores(run, grader).subquery()
        key = items.c.item_key.asc().nulls_last()  # rollouts without an item last, on SQLite as on Postgres
        orders = {
            "mean": (items.c.mean.asc(), key),
            "variance": ((items.c.mean_square - items.c.mean * items.c.mean).desc(), key),
            "rollouts": (items.c.n.desc(), key),
            "item": (key,),
        }
        result = await self.session.execute(
            select(items).order_by(*orders[order]).limit(limit).offset(offset)
        )
        return [
            ItemRow(
                item_key=r.item_key,
                rollouts=int(r.n),
                mean=float(r.mean),
                mean_square=float(r.mean_square),
                min=float(r.lo),
                max=float(r.hi),
            )
            for r in result.all()
        ]

    async def item_summary(
        self, run: str, grader: str | None, *, min_rollouts: int, zero: float, one: float
    ) -> ItemSummary:
        items = self._item_scores(run, grader).subquery()
        repeated = items.c.n >= min_rollouts
        result = await self.session.execute(
            select(
                func.count(),
                func.sum(case((repeated, 1), else_=0)),
                func.sum(case((and_(repeated, items.c.hi <= zero), 1), else_=0)),
                func.sum(case((and_(repeated, items.c.lo >= one), 1), else_=0)),
            )
            .select_from(items)
            .where(items.c.item_key.is_not(None))  # rollouts without an item are not one item
        )
        row = result.one()
        return ItemSummary(
            items=int(row[0]),
            repeated_items=int(row[1] or 0),
            always_zero=int(row[2] or 0),
            always_one=int(row[3] or 0),
        )

    # --- flags -----------------------------------------------------------------------------------------

    def _flag_names(self) -> tuple[Any, Any]:
        """A grade's flags as a table (joined per grade) and the name of each flag in it."""
        if self.dialect == "postgresql":
            element = func.jsonb_array_elements(Grade.flags).table_valued("value", joins_implicitly=True)
            return element, element.c.value.op("->>")("name")
        element = func.json_each(Grade.flags).table_valued("value", joins_implicitly=True)
        return element, func.json_extract(element.c.value, "$.name")

    async def flag_counts(self, run: str | None, grader: str | None) -> list[tuple[str, int]]:
        """Rollouts per flag name, counting each rollout's latest grade."""
        element, name = self._flag_names()
        latest = self._latest_grades(run, grader)
        rollouts = func.count(func.distinct(latest.c.trace_id))
        result = await self.session.execute(
            select(name, rollouts)
            .join_from(latest, Grade, Grade.id == latest.c.grade_id)
            .join(element, true())
            .group_by(name)
            .order_by(rollouts.desc(), name)
        )
        return [(str(r[0]), int(r[1])) for r in result.all()]

    # --- a run: its learning curve ---------------------------------------------------------------------
    # Rollouts are placed by `first_seen` (when their first call arrived) in windows of time or of order.

    async def span(self, run: str) -> tuple[float, float] | None:
        """Unix times of the run's first and last rollout starts (None: no rollout)."""
        row = (
            await self.session.execute(
                select(
                    func.min(self._epoch(RolloutRow.first_seen)), func.max(self._epoch(RolloutRow.first_seen))
                ).where(RolloutRow.run == run)
            )
        ).one()
        return None if row[0] is None else (float(row[0]), float(row[1]))

    def _windowed(
        self, run: str, grader: str | None, axis: str, windows: int, span: tuple[float, float]
    ) -> Any:
        """(trace_id, window, score, calls, grade_id, first_seen) per rollout of the run."""
        latest = aliased(Grade)
        newest = select(func.max(latest.id)).where(latest.trace_id == RolloutRow.trace_id)
        if grader is not None:
            newest = newest.where(latest.grader == grader)
        window: Any
        if axis == "order":
            window = func.ntile(windows).over(order_by=(RolloutRow.first_seen, RolloutRow.trace_id)) - 1
        else:
            start, end = span
            width = (end - start) / windows or 1.0
            position = (self._epoch(RolloutRow.first_seen) - start) / width
            if self.dialect == "postgresql":
                window = func.least(cast(func.floor(position), Integer), windows - 1)
            else:  # SQLite: CAST truncates (positions are >= 0) and a two-argument min() is scalar
                window = func.min(cast(position, Integer), windows - 1)
        return (
            select(
                RolloutRow.trace_id.label("trace_id"),
                window.label("window"),
                Grade.score.label("score"),
                RolloutRow.calls.label("calls"),
                Grade.id.label("grade_id"),
                RolloutRow.first_seen.label("first_seen"),
            )
            .outerjoin(Grade, Grade.id == newest.correlate(RolloutRow).scalar_subquery())
            .where(RolloutRow.run == run)
            .subquery("windowed")
        )

    async def curve_windows(self, run: str, grader: str | None, axis: str, windows: int) -> list[WindowRow]:
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

    async def curve_flags(
        self, run: str, grader: str | None, axis: str, windows: int
    ) -> list[tuple[int, str, int]]:
        """(window, flag name, rollouts whose latest grade raised it)."""
        span = await self.span(run)
        if span is None:
            return []
        w = self._windowed(run, grader, axis, windows, span)
        element, name = self._flag_names()
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
