"""Run statistics: rewards, calls, tools, latencies, items, flags, two runs compared, the learning curve."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.grading.flags import ENVIRONMENT_FAILURES
from app.review import schemas as s
from app.review.stats_repository import ItemRow, ItemSummary, RewardSummary, StatsRepository, ToolRow
from app.review.uncertainty import (
    ItemScores,
    bootstrap_difference,
    combined_error,
    resamples_for,
    standard_error,
)

REWARD_BINS = 10
# Scores at or below ZERO / at or above ONE count as "always 0" / "always 1" for items.
ZERO, ONE = 0.0, 1.0
MAX_ITEM_DELTAS = 2000  # per-item changes returned by compare
MIN_ROLLOUTS_PER_ITEM = 2  # an item seen once is trivially "always" something: not counted


def _std(mean: float | None, mean_square: float | None) -> float | None:
    if mean is None or mean_square is None:
        return None
    return math.sqrt(max(0.0, mean_square - mean * mean))


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


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


def item_stats_of(row: ItemRow) -> s.ItemStats:
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


class RunStatistics:
    """A run's aggregates, each read by one query in the database (see app/review/stats_repository.py)."""

    def __init__(
        self, session: AsyncSession, *, sessions: async_sessionmaker[AsyncSession] | None = None
    ) -> None:
        self.session = session
        self.sessions = sessions  # lets a run's queries spread over connections

    # --- a run ------------------------------------------------------------------------------------------

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
            items=[item_stats_of(r) for r in rows[:limit]],
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
            reward_se=standard_error(_std(reward.mean, reward.mean_square), reward.scored),
        )
        return side, tools, items

    async def compare(self, a: str, b: str, grader: str | None = None) -> s.RunComparison:
        (side_a, tools_a, items_a), (side_b, tools_b, items_b) = (
            await asyncio.gather(self._side(a, grader), self._side(b, grader))
            if self.sessions is not None
            else (await self._side(a, grader), await self._side(b, grader))
        )
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
        scores_a = [ItemScores(r.rollouts, r.mean * r.rollouts) for r in items_a]
        scores_b = [ItemScores(r.rollouts, r.mean * r.rollouts) for r in items_b]
        # CPU work over every item: off the event loop.
        interval = await asyncio.to_thread(bootstrap_difference, scores_a, scores_b)
        return s.RunComparison(
            a=side_a,
            b=side_b,
            reward_delta=_delta(side_a.reward_mean, side_b.reward_mean),
            reward_delta_se=combined_error(side_a.reward_se, side_b.reward_se),
            reward_delta_ci=interval,
            bootstrap_resamples=resamples_for(len(scores_a), len(scores_b)) if interval is not None else 0,
            calls_per_rollout_delta=_delta(side_a.calls_per_rollout, side_b.calls_per_rollout),
            latency_p50_delta_ms=_delta(side_a.latency.p50_ms, side_b.latency.p50_ms),
            tool_mix=_tool_mix(tools_a, tools_b),
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
        rows, flagged, span = await self._concurrently(
            lambda r: r.curve_windows(run, grader, axis, windows),
            lambda r: r.curve_flags(run, grader, axis, windows),
            lambda r: r.span(run),
        )
        start_end = span if axis == "time" else None
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

    async def flag_counts(self, run: str | None, grader: str | None = None) -> list[s.FlagCount]:
        (counts,) = await self._concurrently(lambda r: r.flag_counts(run, grader))
        return [s.FlagCount(name=n, rollouts=c) for n, c in counts]


def _tool_mix(tools_a: Sequence[ToolRow], tools_b: Sequence[ToolRow]) -> list[s.ToolMix]:
    """Each tool's calls and share of its run's calls in both runs, the most called first."""
    calls_a = {t.tool or "": t.calls for t in tools_a}
    calls_b = {t.tool or "": t.calls for t in tools_b}
    total_a, total_b = sum(calls_a.values()), sum(calls_b.values())

    def mix(tool: str) -> s.ToolMix:
        share_a = calls_a.get(tool, 0) / total_a if total_a else 0.0
        share_b = calls_b.get(tool, 0) / total_b if total_b else 0.0
        return s.ToolMix(
            tool=tool,
            calls_a=calls_a.get(tool, 0),
            calls_b=calls_b.get(tool, 0),
            share_a=share_a,
            share_b=share_b,
            share_delta=share_b - share_a,
        )

    order = sorted(set(calls_a) | set(calls_b), key=lambda t: (-(calls_a.get(t, 0) + calls_b.get(t, 0)), t))
    return [mix(tool) for tool in order]


def _capped(deltas: list[s.ItemDelta]) -> list[s.ItemDelta]:
    """The most improved and the most regressed halves of a long list (it is sorted by change)."""
    if len(deltas) <= MAX_ITEM_DELTAS:
        return deltas
    half = MAX_ITEM_DELTAS // 2
    return deltas[:half] + deltas[-half:]


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a
