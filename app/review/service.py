"""Review logic: flags at grade time and on demand, timelines, run and item statistics, export."""

from __future__ import annotations

import asyncio
import base64
import binascii
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.db.models import Grade, Rollout
from app.errors import BadRequest, NotFound
from app.grading.flags import (
    DEFAULT_POLICY,
    ENVIRONMENT_FAILURES,
    FLAG_NAMES,
    FlagPolicy,
    answer_hash,
    final_answer,
)
from app.grading.recording import review_flags
from app.grading.repository import GradeRepository
from app.review import schemas as s
from app.review.curve_repository import CurveRepository, WindowRow
from app.review.repository import ReviewRepository, RolloutFilter
from app.review.stats_repository import ItemRow, ItemSummary, RewardSummary, StatsRepository, ToolRow
from app.rollouts.repository import RolloutRepository
from app.rollouts.timeline import LoggedCall, RolloutTimeline, build_timeline, read_timeline, rollout_calls

REWARD_BINS = 10
# Scores at or below ZERO / at or above ONE count as "always 0" / "always 1" for items.
ZERO, ONE = 0.0, 1.0
MAX_ITEM_DELTAS = 2000  # per-item changes returned by compare
MIN_ROLLOUTS_PER_ITEM = 2  # an item seen once is trivially "always" something: not counted


def encode_cursor(key: Any, trace_id: str, sort: str = "time") -> str:
    """The position after a page's last row: its sort key and trace id (the sort is named, to check)."""
    value = key.isoformat() if isinstance(key, datetime) else float(key)
    raw = [value, trace_id] if sort == "time" else [sort, value, trace_id]
    return base64.urlsafe_b64encode(orjson.dumps(raw)).decode().rstrip("=")


def decode_cursor(cursor: str, sort: str = "time") -> tuple[Any, str]:
    invalid = BadRequest(
        "invalid cursor: pass next_cursor from the previous page unchanged, with the same sort"
    )
    try:
        raw = orjson.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if sort == "time":
            if len(raw) != 2:
                raise invalid
            return datetime.fromisoformat(raw[0]), str(raw[1])
        if len(raw) != 3 or raw[0] != sort or isinstance(raw[1], bool):
            raise invalid
        return float(raw[1]), str(raw[2])
    except (binascii.Error, orjson.JSONDecodeError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise invalid from exc


def _std(mean: float | None, mean_square: float | None) -> float | None:
    if mean is None or mean_square is None:
        return None
    return math.sqrt(max(0.0, mean_square - mean * mean))


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def flags_of(grade: Grade) -> list[s.FlagOut]:
    """The grade's flags, each name once: a name raised twice (by the grader and by the review checks)
    keeps the first reason that has evidence, else the first, and the evidence of both."""
    out: dict[str, s.FlagOut] = {}
    for raw in grade.flags or []:
        if not (isinstance(raw, dict) and "name" in raw):
            continue
        name = str(raw["name"])
        evidence = [int(e) for e in raw.get("evidence") or [] if isinstance(e, int)]
        seen = out.get(name)
        if seen is None:
            out[name] = s.FlagOut(name=name, reason=str(raw.get("reason", "")), evidence=evidence)
            continue
        merged = seen.evidence + [e for e in evidence if e not in seen.evidence]
        reason = seen.reason if seen.evidence or not evidence else str(raw.get("reason", ""))
        out[name] = s.FlagOut(name=name, reason=reason, evidence=sorted(merged))
    return list(out.values())


def grade_out(grade: Grade) -> s.GradeOut:
    return s.GradeOut(
        id=grade.id,
        grader=grade.grader,
        grader_version=grade.grader_version,
        status=grade.status,
        score=grade.score,
        sub_scores=grade.sub_scores or {},
        flags=flags_of(grade),
        errors=list(grade.errors or []),
        answer=final_answer(grade.sample or {}),
        answer_hash=grade.answer_hash,
        item_key=grade.item_key,
        run=grade.run,
        latency_ms=grade.latency_ms,
        created_at=grade.created_at,
    )


def export_record(rollout: Rollout, calls: Sequence[LoggedCall], grades: Sequence[Grade]) -> dict[str, Any]:
    """One JSONL line of the export: the rollout, its calls in order, its grades."""
    return {
        "trace_id": rollout.trace_id,
        "run": rollout.run,
        "item_key": rollout.item_key,
        "first_seen": rollout.first_seen,
        "last_seen": rollout.last_seen,
        "graded_at": rollout.graded_at,
        "calls": [call.model_dump() for call in rollout_calls(calls)],
        "grades": [
            {
                "grader": g.grader,
                "grader_version": g.grader_version,
                "status": g.status,
                "score": g.score,
                "sub_scores": g.sub_scores,
                "flags": g.flags,
                "errors": g.errors,
                "answer_hash": g.answer_hash,
                "item_key": g.item_key,
                "run": g.run,
                "sample": g.sample,
                "item": g.item,
                "latency_ms": g.latency_ms,
                "created_at": g.created_at,
            }
            for g in grades
        ],
    }


def _count_histogram(distribution: Sequence[tuple[int, int]]) -> s.Histogram:
    """One bin per call count up to 30 calls, else 20 equal bins (edges are call counts)."""
    if not distribution:
        return s.Histogram(edges=[0.0, 1.0], counts=[0])
    top = max(n for n, _ in distribution)
    if top <= 30:
        counts = [0] * (top + 1)
        for n, count in distribution:
            counts[n] += count
        return s.Histogram(edges=[float(i) for i in range(top + 2)], counts=counts)
    width = math.ceil((top + 1) / 20)
    counts = [0] * 20
    for n, count in distribution:
        counts[min(19, n // width)] += count
    return s.Histogram(edges=[float(i * width) for i in range(21)], counts=counts)


def _rank(distribution: Sequence[tuple[int, int]], q: float) -> int | None:
    total = sum(count for _, count in distribution)
    if not total:
        return None
    target = max(1, math.ceil(q * total))
    seen = 0
    for n, count in distribution:
        seen += count
        if seen >= target:
            return n
    return distribution[-1][0]


def _latency(row: ToolRow) -> s.LatencyStats:
    p = row.percentiles
    return s.LatencyStats(
        mean_ms=row.latency_mean_ms if row.calls else None,
        p50_ms=p[0] if p else None,
        p90_ms=p[1] if p else None,
        p99_ms=p[2] if p else None,
    )


def _tool_stats(row: ToolRow, total_calls: int) -> s.ToolStats:
    p = row.percentiles
    return s.ToolStats(
        tool=row.tool or "",
        calls=row.calls,
        share=row.calls / total_calls if total_calls else 0.0,
        latency_mean_ms=row.latency_mean_ms,
        latency_p50_ms=p[0] if p else None,
        latency_p90_ms=p[1] if p else None,
        latency_p99_ms=p[2] if p else None,
        latency_max_ms=row.latency_max_ms,
        output_bytes_mean=(row.output_bytes or 0) / row.calls if row.calls else 0.0,
        outcomes=row.outcomes,
        errors=sum(row.outcomes.get(o, 0) for o in ENVIRONMENT_FAILURES),
    )


def _item_summary(summary: ItemSummary) -> s.ItemSummaryOut:
    repeated = summary.repeated_items
    return s.ItemSummaryOut(
        items=summary.items,
        repeated_items=repeated,
        always_zero=summary.always_zero,
        always_one=summary.always_one,
        share_always_zero=_share(summary.always_zero, repeated),
        share_always_one=_share(summary.always_one, repeated),
        share_no_signal=_share(summary.always_zero + summary.always_one, repeated),
    )


def _item_stats(row: ItemRow) -> s.ItemStats:
    variance = max(0.0, row.mean_square - row.mean * row.mean)
    repeated = row.rollouts >= MIN_ROLLOUTS_PER_ITEM
    return s.ItemStats(
        item_key=row.item_key,
        rollouts=row.rollouts,
        mean=row.mean,
        variance=variance,
        std=math.sqrt(variance),
        min=row.min,
        max=row.max,
        always_zero=repeated and row.max <= ZERO,
        always_one=repeated and row.min >= ONE,
    )


class ReviewService:
    def __init__(
        self,
        session: AsyncSession,
        policy: FlagPolicy = DEFAULT_POLICY,
        *,
        sessions: async_sessionmaker[AsyncSession] | None = None,
    ) -> None:
        self.session = session
        self.repo = ReviewRepository(session)
        self.policy = policy
        self.sessions = sessions  # lets run statistics spread their queries over connections

    # --- flags -----------------------------------------------------------------------------------------

    async def recompute_flags(self, trace_id: str) -> list[Grade]:
        """Recompute the review flags of every grade of a rollout from what is stored (flushes, no commit).

        Flags a grader raised itself (names outside FLAG_NAMES) are kept.
        """
        grade_repo = GradeRepository(self.session)
        grades = await grade_repo.for_trace(trace_id)
        if not grades:
            raise NotFound(f"no grades for trace_id {trace_id!r}")
        timeline = await read_timeline(self.session, trace_id)
        calls = timeline.calls if timeline is not None else []
        for grade in grades:
            answer = final_answer(grade.sample or {})
            flags = await review_flags(
                grade_repo,
                calls=calls,
                answer=answer,
                score=grade.score,
                status=grade.status,
                errors=[str(e) for e in grade.errors or []],
                item_key=grade.item_key,
                policy=self.policy,
            )
            kept = [f for f in grade.flags or [] if not (isinstance(f, dict) and f.get("name") in FLAG_NAMES)]
            grade.flags = kept + [f.as_json() for f in flags]
            if grade.answer_hash is None and answer.strip():
                grade.answer_hash = answer_hash(answer)
        await self.session.flush()
        return list(grades)

    # --- rollouts --------------------------------------------------------------------------------------

    async def rollouts(
        self,
        filters: RolloutFilter,
        *,
        limit: int,
        cursor: str | None,
        sort: str = "time",
        descending: bool = True,
        count: bool = False,
    ) -> s.RolloutPage:
        before = decode_cursor(cursor, sort) if cursor else None
        rows = await self.repo.rollouts(
            filters, limit=limit + 1, before=before, sort=sort, descending=descending
        )
        page = rows[:limit]
        out = [
            s.RolloutSummary(
                trace_id=row.rollout.trace_id,
                run=row.rollout.run,
                channel=row.rollout.channel,
                item_key=row.rollout.item_key or (row.grade.item_key if row.grade else None),
                first_seen=row.rollout.first_seen,
                last_seen=row.rollout.last_seen,
                graded_at=row.rollout.graded_at,
                calls=row.calls,
                grader=row.grade.grader if row.grade else None,
                status=row.grade.status if row.grade else None,
                score=row.grade.score if row.grade else None,
                flags=[f.name for f in flags_of(row.grade)] if row.grade else [],
            )
            for row in page
        ]
        last = page[-1] if page else None
        next_cursor = (
            encode_cursor(last.key, last.rollout.trace_id, sort) if last and len(rows) > limit else None
        )
        total = await self.repo.count_rollouts(filters) if count else None
        return s.RolloutPage(rollouts=out, next_cursor=next_cursor, total=total)

    async def graded_on(self, trace_id: str, grader: str | None = None) -> s.GradedOn:
        """The dataset row and sample of the rollout's latest grade (of `grader`), with item statistics."""
        rollout = await RolloutRepository(self.session).get(trace_id)
        stored = await GradeRepository(self.session).for_trace(trace_id)
        grades = [g for g in stored if grader is None or g.grader == grader]
        if rollout is None and not grades:
            raise NotFound(f"no rollout with trace_id {trace_id!r}")
        grade = grades[-1] if grades else None
        run = rollout.run if rollout is not None else (grade.run if grade else None)
        key = (rollout.item_key if rollout is not None else None) or (grade.item_key if grade else None)
        scores = None
        if key is not None:
            scores = await self.score_summary(RolloutFilter(run=run, item_key=key, grader=grader))
        sample = dict(grade.sample or {}) if grade else None
        return s.GradedOn(
            trace_id=trace_id,
            grade_id=grade.id if grade else None,
            grader=grade.grader if grade else grader,
            run=run,
            item_key=key,
            item=dict(grade.item) if grade and grade.item is not None else None,
            sample=sample,
            answer=final_answer(sample or {}),
            output_tools=_output_tools(sample or {}),
            item_scores=scores,
        )

    async def score_summary(self, filters: RolloutFilter) -> s.ItemStats | None:
        """Mean, variance, min, max of the latest scores of the rollouts the filters match."""
        row = await self.repo.score_summary(filters)
        return _item_stats(row) if row is not None else None

    async def graders(self, run: str | None = None) -> list[s.GraderOut]:
        return [s.GraderOut(grader=g.grader, rollouts=g.rollouts) for g in await self.repo.graders(run)]

    async def runs(self, channel: str | None = None) -> list[s.RunOut]:
        return [
            s.RunOut(
                run=r.run,
                rollouts=r.rollouts,
                channels=r.channels,
                first_seen=r.first_seen,
                last_seen=r.last_seen,
            )
            for r in await self.repo.runs(channel=channel)
        ]

    async def timeline(self, trace_id: str) -> s.Timeline:
        base = await read_timeline(self.session, trace_id)
        grades = await GradeRepository(self.session).for_trace(trace_id)
        if base is None and not grades:
            raise NotFound(f"no rollout with trace_id {trace_id!r}")
        if base is None:
            base = build_timeline(trace_id, None, [])
        graded = [grade_out(g) for g in grades]
        cited: dict[int, list[str]] = {}
        for grade in graded:
            for flag in grade.flags:
                for seq in flag.evidence:
                    names = cited.setdefault(seq, [])
                    if flag.name not in names:
                        names.append(flag.name)
        header = {name: getattr(base, name) for name in RolloutTimeline.model_fields if name != "calls"}
        return s.Timeline(
            **header,
            calls=[s.CallOut(**dict(call), flags=cited.get(call.seq, [])) for call in base.calls],
            grades=graded,
        )

    # --- runs ------------------------------------------------------------------------------------------

    async def _concurrently(self, *queries: Callable[[StatsRepository], Awaitable[Any]]) -> list[Any]:
        """Independent read-only aggregates, each on its own connection when a sessionmaker was given
        (Postgres then runs them side by side: a run's statistics cost the slowest query, not the sum)."""
        sessions = self.sessions
        if sessions is None:
            stats = StatsRepository(self.session)
            await stats.prepare_for_aggregates()
            return [await query(stats) for query in queries]

        async def one(query: Callable[[StatsRepository], Awaitable[Any]]) -> Any:
            async with sessions() as session:
                repo = StatsRepository(session)
                await repo.prepare_for_aggregates()
                return await query(repo)

        return list(await asyncio.gather(*(one(q) for q in queries)))

    async def run_stats(self, run: str, grader: str | None = None) -> s.RunStats:
        queries: list[Callable[[StatsRepository], Awaitable[Any]]] = [
            lambda r: r.reward_distribution(run, grader, REWARD_BINS),
            lambda r: r.call_stats(run),
            lambda r: r.calls_per_rollout(run),
            lambda r: r.item_summary(run, grader, min_rollouts=MIN_ROLLOUTS_PER_ITEM, zero=ZERO, one=ONE),
            lambda r: r.flag_counts(run, grader),
        ]
        results = await self._concurrently(*queries)
        reward: RewardSummary = results[0]
        tools, overall = results[1]
        distribution: list[tuple[int, int]] = results[2]

        rollouts_counted = sum(count for _, count in distribution)
        calls_counted = sum(n * count for n, count in distribution)
        errors_by_outcome = dict(overall.outcomes)
        return s.RunStats(
            run=run,
            grader=grader,
            rollouts=reward.rollouts,
            reward=s.RewardStats(
                graded=reward.graded,
                failed=reward.failed,
                scored=reward.scored,
                mean=reward.mean,
                std=_std(reward.mean, reward.mean_square),
                min=reward.min,
                max=reward.max,
                histogram=s.Histogram(edges=reward.edges, counts=reward.counts),
            ),
            calls_per_rollout=s.CountDistribution(
                values=[n for n, _ in distribution],
                counts=[c for _, c in distribution],
                mean=calls_counted / rollouts_counted if rollouts_counted else None,
                p50=_rank(distribution, 0.5),
                p90=_rank(distribution, 0.9),
                max=distribution[-1][0] if distribution else None,
            ),
            calls_per_rollout_histogram=_count_histogram(distribution),
            tools=[_tool_stats(t, overall.calls) for t in tools],
            errors_by_outcome=errors_by_outcome,
            platform=s.PlatformMetrics(
                tool_calls_per_rollout=calls_counted / rollouts_counted if rollouts_counted else None,
                output_bytes_per_call=(overall.output_bytes or 0) / overall.calls if overall.calls else None,
                tool_latency=_latency(overall),
                tool_errors=sum(errors_by_outcome.get(o, 0) for o in ENVIRONMENT_FAILURES),
                model_errors=errors_by_outcome.get("model_error", 0),
            ),
            items=_item_summary(results[3]),
            flags=[s.FlagCount(name=name, rollouts=count) for name, count in results[4]],
        )

    async def item_stats(
        self, run: str, grader: str | None = None, *, order: str = "mean", limit: int = 500, offset: int = 0
    ) -> s.ItemStatsPage:
        rows, summary = await self._concurrently(
            lambda r: r.item_stats(run, grader, order=order, limit=limit + 1, offset=offset),
            lambda r: r.item_summary(run, grader, min_rollouts=MIN_ROLLOUTS_PER_ITEM, zero=ZERO, one=ONE),
        )
        return s.ItemStatsPage(
            run=run,
            grader=grader,
            summary=_item_summary(summary),
            items=[_item_stats(r) for r in rows[:limit]],
            next_offset=offset + limit if len(rows) > limit else None,
        )

    async def _side(self, run: str, grader: str | None) -> tuple[s.RunSide, list[ToolRow], list[ItemRow]]:
        reward, (tools, overall), summary, items, channels = await self._concurrently(
            lambda r: r.reward_distribution(run, grader, REWARD_BINS),
            lambda r: r.call_stats(run),
            lambda r: r.item_summary(run, grader, min_rollouts=MIN_ROLLOUTS_PER_ITEM, zero=ZERO, one=ONE),
            lambda r: r.item_stats(run, grader, order="item", limit=1_000_000, offset=0),
            lambda r: r.channels(run),
        )
        model_errors = overall.outcomes.get("model_error", 0)
        side = s.RunSide(
            run=run,
            rollouts=reward.rollouts,
            reward_mean=reward.mean,
            reward_std=_std(reward.mean, reward.mean_square),
            graded=reward.graded,
            calls_per_rollout=overall.calls / reward.rollouts if reward.rollouts else None,
            latency=_latency(overall),
            output_bytes_per_call=(overall.output_bytes or 0) / overall.calls if overall.calls else None,
            tool_errors=sum(overall.outcomes.get(o, 0) for o in ENVIRONMENT_FAILURES),
            model_errors=model_errors,
            model_error_share=_share(model_errors, overall.calls),
            channels=channels,
            share_no_signal=_item_summary(summary).share_no_signal,
            reward_min=reward.min,
            reward_max=reward.max,
        )
        return side, tools, items

    async def compare(self, a: str, b: str, grader: str | None = None) -> s.RunComparison:
        (side_a, tools_a, items_a), (side_b, tools_b, items_b) = (
            await asyncio.gather(self._side(a, grader), self._side(b, grader))
            if self.sessions is not None
            else (await self._side(a, grader), await self._side(b, grader))
        )
        calls_a = {t.tool or "": t.calls for t in tools_a}
        calls_b = {t.tool or "": t.calls for t in tools_b}
        total_a, total_b = sum(calls_a.values()), sum(calls_b.values())
        mix = [
            s.ToolMix(
                tool=tool,
                calls_a=calls_a.get(tool, 0),
                calls_b=calls_b.get(tool, 0),
                share_a=calls_a.get(tool, 0) / total_a if total_a else 0.0,
                share_b=calls_b.get(tool, 0) / total_b if total_b else 0.0,
                share_delta=(calls_b.get(tool, 0) / total_b if total_b else 0.0)
                - (calls_a.get(tool, 0) / total_a if total_a else 0.0),
            )
            for tool in sorted(
                set(calls_a) | set(calls_b), key=lambda t: (-(calls_a.get(t, 0) + calls_b.get(t, 0)), t)
            )
        ]
        by_a = {r.item_key: r for r in items_a}
        common = [(by_a[r.item_key], r) for r in items_b if r.item_key in by_a]
        deltas = [b.mean - a.mean for a, b in common]
        item_deltas = sorted(
            (
                s.ItemDelta(
                    item_key=b.item_key,
                    rollouts_a=a.rollouts,
                    rollouts_b=b.rollouts,
                    mean_a=a.mean,
                    mean_b=b.mean,
                    delta=b.mean - a.mean,
                )
                for a, b in common
            ),
            key=lambda d: (-d.delta, d.item_key or ""),
        )
        hist_a, hist_b = await self._common_histograms(a, b, grader, side_a, side_b)
        return s.RunComparison(
            a=side_a,
            b=side_b,
            reward_delta=_delta(side_a.reward_mean, side_b.reward_mean),
            calls_per_rollout_delta=_delta(side_a.calls_per_rollout, side_b.calls_per_rollout),
            latency_p50_delta_ms=_delta(side_a.latency.p50_ms, side_b.latency.p50_ms),
            tool_mix=mix,
            items=s.ItemChanges(
                common=len(deltas),
                improved=sum(d > 1e-9 for d in deltas),
                regressed=sum(d < -1e-9 for d in deltas),
                unchanged=sum(abs(d) <= 1e-9 for d in deltas),
                mean_delta=sum(deltas) / len(deltas) if deltas else None,
            ),
            reward_histogram_a=hist_a,
            reward_histogram_b=hist_b,
            item_deltas=_capped(item_deltas),
            item_deltas_capped=len(item_deltas) > MAX_ITEM_DELTAS,
        )

    async def _common_histograms(
        self, a: str, b: str, grader: str | None, side_a: s.RunSide, side_b: s.RunSide
    ) -> tuple[s.Histogram, s.Histogram]:
        """Both runs' latest scores on one set of edges: [0, 1], widened to every score of either run."""
        lo = min([0.0, *(v for v in (side_a.reward_min, side_b.reward_min) if v is not None)])
        hi = max([1.0, *(v for v in (side_a.reward_max, side_b.reward_max) if v is not None)])
        edges = [lo + (hi - lo) * i / REWARD_BINS for i in range(REWARD_BINS + 1)]
        counts_a, counts_b = await self._concurrently(
            lambda r: r.reward_histogram(a, grader, edges), lambda r: r.reward_histogram(b, grader, edges)
        )
        return s.Histogram(edges=edges, counts=counts_a), s.Histogram(edges=edges, counts=counts_b)

    async def reward_curve(
        self, run: str, grader: str | None = None, *, axis: str = "time", windows: int = 20
    ) -> s.RewardCurve:
        """Reward, calls, tool errors and flags per window of time (or of rollout order)."""
        rows, flagged = await self._concurrently_curve(run, grader, axis, windows)
        start_end = await CurveRepository(self.session).span(run) if axis == "time" else None
        per_window: dict[int, dict[str, int]] = {}
        totals: dict[str, int] = {}
        for index, name, count in flagged:
            per_window.setdefault(index, {})[name] = count
            totals[name] = totals.get(name, 0) + count
        out = []
        for row in rows:
            start, end = row.first, row.last
            if start_end is not None:
                width = (start_end[1] - start_end[0]) / windows
                start = datetime.fromtimestamp(start_end[0] + row.index * width, UTC)
                end = datetime.fromtimestamp(start_end[0] + (row.index + 1) * width, UTC)
            out.append(
                s.CurveWindow(
                    index=row.index,
                    start=start,
                    end=end,
                    rollouts=row.rollouts,
                    scored=row.scored,
                    reward_mean=row.mean,
                    reward_std=_std(row.mean, row.mean_square),
                    calls_per_rollout=row.calls_mean,
                    tool_errors=row.tool_errors,
                    tool_errors_per_rollout=row.tool_errors / row.rollouts if row.rollouts else 0.0,
                    flags=per_window.get(row.index, {}),
                )
            )
        names = sorted(totals, key=lambda n: (-totals[n], n))
        return s.RewardCurve(run=run, grader=grader, axis=axis, windows=out, flag_names=names)

    async def _concurrently_curve(
        self, run: str, grader: str | None, axis: str, windows: int
    ) -> tuple[list[WindowRow], list[tuple[int, str, int]]]:
        async def rows(session: AsyncSession) -> list[WindowRow]:
            return await CurveRepository(session).windows(run, grader, axis, windows)

        async def flagged(session: AsyncSession) -> list[tuple[int, str, int]]:
            return await CurveRepository(session).flags(run, grader, axis, windows)

        if self.sessions is None:
            return await rows(self.session), await flagged(self.session)
        sessions = self.sessions

        async def on_its_own(query: Callable[[AsyncSession], Awaitable[Any]]) -> Any:
            async with sessions() as session:
                await StatsRepository(session).prepare_for_aggregates()
                return await query(session)

        first, second = await asyncio.gather(on_its_own(rows), on_its_own(flagged))
        return first, second

    async def flag_counts(self, run: str | None, grader: str | None = None) -> list[s.FlagCount]:
        (counts,) = await self._concurrently(lambda r: r.flag_counts(run, grader))
        return [s.FlagCount(name=n, rollouts=c) for n, c in counts]

    # --- export ----------------------------------------------------------------------------------------

    async def export_lines(self, run: str | None) -> AsyncIterator[bytes]:
        async for batch in self.repo.export_batches(run):
            for rollout, calls, grades in batch:
                yield orjson.dumps(export_record(rollout, calls, grades)) + b"\n"


def _output_tools(sample: dict[str, Any]) -> list[Any]:
    listed = sample.get("output_tools")
    if isinstance(listed, list) and listed:
        return listed
    choices = sample.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[-1], dict):
        message = choices[-1].get("message")
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            return calls
    return []


def _capped(deltas: list[s.ItemDelta]) -> list[s.ItemDelta]:
    """The most improved and the most regressed halves of a long list (it is sorted by change)."""
    if len(deltas) <= MAX_ITEM_DELTAS:
        return deltas
    half = MAX_ITEM_DELTAS // 2
    return deltas[:half] + deltas[-half:]


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a
