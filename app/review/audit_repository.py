"""The queries of a run's audit: its graded rollouts in arrival order, with what each signal reads."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Integer, case, func, select

from app.db.models import Grade, RolloutRow, ToolCall
from app.review.repository import ReviewRepository

# Outcomes of an attempt that count as a tool error: the model's mistake (an `Error: ...` output) or
# the environment's failure.
ERROR_OUTCOMES = ("model_error", "tool_crash", "infra_error")


@dataclass(frozen=True)
class AuditRow:
    trace_id: str
    item_key: str | None
    calls: int
    score: float | None
    sub_scores: dict[str, float]
    flagged: bool
    answer_chars: int
    tools: int = 0  # distinct tools called
    errors: int = 0  # attempts that answered an error or failed


class AuditRepository(ReviewRepository):
    async def in_order(self, run: str, grader: str | None, *, cap: int) -> list[AuditRow]:
        """The run's rollouts in the order their first call arrived, with their latest grade (of `grader`)."""
        query = (
            select(
                RolloutRow.trace_id,
                func.coalesce(RolloutRow.item_key, Grade.item_key),
                RolloutRow.__table__.c.calls,
                Grade.score,
                Grade.sub_scores,
                Grade.flags,
                func.length(func.coalesce(self._answer_text(), "")),
                RolloutRow.first_seen,
                RolloutRow.last_seen,
            )
            .select_from(RolloutRow)
            .join(Grade, Grade.id == self._latest_grade_id(grader))
            .where(RolloutRow.run == run)
            .order_by(RolloutRow.first_seen, RolloutRow.trace_id)
            .limit(cap)
        )
        found = (await self.session.execute(query)).all()
        rows = [
            AuditRow(
                trace_id=r[0],
                item_key=r[1],
                calls=int(r[2] or 0),
                score=r[3],
                sub_scores=_numbers(r[4]),
                flagged=bool(r[5]),
                answer_chars=int(r[6] or 0),
            )
            for r in found
        ]
        span = (min(r[7] for r in found), max(r[8] for r in found)) if found else None
        tools = await self._tool_counts([r.trace_id for r in rows], span)
        return [
            replace(r, tools=tools[r.trace_id][0], errors=tools[r.trace_id][1]) if r.trace_id in tools else r
            for r in rows
        ]

    async def _tool_counts(
        self, trace_ids: list[str], span: tuple[datetime, datetime] | None
    ) -> dict[str, tuple[int, int]]:
        """Per rollout: distinct tools called, attempts that were errors. `span`: the rollouts' (their
        rows' first first_seen, last last_seen): a partitioned log is read on those days only."""
        counts: dict[str, tuple[int, int]] = {}
        errors = func.sum(case((ToolCall.outcome.in_(ERROR_OUTCOMES), 1), else_=0)).cast(Integer)
        for start in range(0, len(trace_ids), 1000):
            query = (
                select(ToolCall.trace_id, func.count(func.distinct(ToolCall.tool)), errors)
                .where(
                    ToolCall.trace_id.in_(trace_ids[start : start + 1000]),
                    *([ToolCall.started_at.between(*span)] if span is not None else []),
                )
                .group_by(ToolCall.trace_id)
            )
            for trace_id, distinct, failed in (await self.session.execute(query)).all():
                counts[trace_id] = (int(distinct), int(failed or 0))
        return counts


def _numbers(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    return {
        str(k): float(v) for k, v in value.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
