"""The call log as read: which attempts of a call stand in its rollout, and where its answer is placed.

Every attempt of a tool call has its own row (`ToolCall`). A call (a `trace_id` and a `call_id`) is
answered by its last answered attempt (`ok`, `model_error`, or `replayed` from the ledger; an
attempt that ran is preferred to a replay of it), placed at the call's first start. A voided attempt
(its answer was never sent) is an `infra_error`, so it never answers. Every other attempt (a failure,
a call without a `call_id`, a `call_id_reused`) stands on its own. The timeline, the counts, the
flags and the statistics all read the log through this rule.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, case, exists, func, or_, select, tuple_
from sqlalchemy.orm import aliased

from app.db.models import ToolCall
from sparring.wire import ANSWERS, REPLAYED

# Outcomes of an attempt that may be its call's answer.


def _rank(attempt: Any) -> Any:
    """How an answering attempt ranks among its call's: one that ran over a replay, then the latest."""
    return tuple_(case((attempt.outcome == REPLAYED, 0), else_=1), attempt.started_at, attempt.id)


def answers_its_call(attempt: Any = ToolCall) -> ColumnElement[bool]:
    """Whether an attempt (a `ToolCall` or an alias of it) may answer a call: answered, with a call_id."""
    return and_(attempt.call_id.is_not(None), attempt.outcome.in_(ANSWERS))


def _since(attempt: Any, since: datetime | None, until: datetime | None = None) -> list[ColumnElement[bool]]:
    """Attempts started within [since, until]: on a partitioned log (Postgres) the planner then reads
    only the partitions of those days, instead of probing every day's index for every row."""
    return [
        *([attempt.started_at >= since] if since is not None else []),
        *([attempt.started_at <= until] if until is not None else []),
    ]


def stands(
    attempt: Any = ToolCall, *, since: datetime | None = None, until: datetime | None = None
) -> ColumnElement[bool]:
    """The predicate of the rule: the attempt is read, unless it is an answer a better one supersedes.

    `since`, `until`: no attempt of the calls read started outside them: the span of their rollouts'
    rows (first_seen to last_seen, which the log writer keeps around every attempt of the rollout)."""
    better = aliased(ToolCall)
    superseded = exists().where(
        better.trace_id == attempt.trace_id,
        better.call_id == attempt.call_id,
        better.outcome.in_(ANSWERS),
        _rank(better) > _rank(attempt),
        *_since(better, since, until),
    )
    return or_(~answers_its_call(attempt), ~superseded)


def placed_start(
    attempt: Any = ToolCall, *, since: datetime | None = None, until: datetime | None = None
) -> ColumnElement[Any]:
    """Where an attempt is placed in its rollout: a call's answer at the call's first start."""
    first = aliased(ToolCall)
    first_start = (
        select(func.min(first.started_at))
        .where(
            first.trace_id == attempt.trace_id, first.call_id == attempt.call_id, *_since(first, since, until)
        )
        .scalar_subquery()
    )
    return case((answers_its_call(attempt), first_start), else_=attempt.started_at)


def logged_calls(
    *conditions: ColumnElement[bool], since: datetime | None = None, until: datetime | None = None
) -> Select[Any]:
    """The log as read (the rows `conditions` select, e.g. some trace ids): every column of
    `tool_calls`, `started_at` as placed, ordered by rollout, placed start and attempt.

    `since`, `until`: the span of the rollouts read, their rows' earliest `first_seen` and latest
    `last_seen`. Every attempt a rollout's row counts started within it (the log writer keeps
    `first_seen` the least start and `last_seen` the latest end), so the result is the rollouts' log
    as of their rows, read from the partitions of those days only."""
    placed = placed_start(since=since, until=until).label("started_at")
    columns = [placed if c.name == "started_at" else c for c in ToolCall.__table__.c]
    return (
        select(*columns)
        .where(stands(since=since, until=until), *conditions, *_since(ToolCall, since, until))
        .order_by(ToolCall.trace_id, placed, ToolCall.id)
    )
