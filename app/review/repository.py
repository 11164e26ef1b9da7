"""The review's lists: filtered rollouts, runs, the graded rollouts of a run, export batches.

Portable across Postgres and SQLite; where they differ (JSON containment) the query branches on the
dialect here. A run's statistics (and its learning curve) are in app/review/stats_repository.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import (
    ColumnElement,
    Float,
    Row,
    Text,
    and_,
    cast,
    exists,
    func,
    literal,
    or_,
    select,
    tuple_,
    type_coerce,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import aliased

from app.db.call_log import logged_calls
from app.db.models import Grade, RolloutLabel, RolloutRow, ToolCall
from app.db.session import UNICODE_LOWER
from app.review.stats_repository import ItemRow, Queries


@dataclass(frozen=True)
class RolloutFilter:
    run: str | None = None
    item_key: str | None = None
    min_score: float | None = None
    max_score: float | None = None
    flag: str | None = None
    tool: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    grader: str | None = None  # the latest grade *of this grader* counts; None: the latest of any
    status: str | None = None  # ok | failed | ungraded
    channel: str | None = None  # rft | mcp
    q: str | None = None  # a fragment of the trace id, the item key or the latest grade's answer
    label: str | None = None  # pass | fail | unlabelled (a person's label)


# Orders of the rollout list; each is keyset-paginated on (key, trace_id).
SORTS = ("time", "score", "calls", "duration")
# Ungraded rollouts (no score) sort below every score.
NO_SCORE = -1e300


@dataclass(frozen=True)
class GraderRow:
    grader: str
    rollouts: int  # rollouts with at least one grade of this grader


@dataclass(frozen=True)
class ListedRollout:
    rollout: RolloutRow
    call_count: int
    grade: Grade | None
    key: Any = None  # the value of the sort key, for the next page's cursor
    label: str | None = None


@dataclass(frozen=True)
class RunRow:
    run: str | None
    rollouts: int
    first_seen: datetime
    last_seen: datetime
    channels: dict[str, int]


@dataclass(frozen=True)
class RunScoreRow:
    """Scores of a run's rollouts in one window (of equal numbers of rollouts, by start) by one grader."""

    run: str
    window: int
    grader: str
    scored: int
    total: float


def _in_channel(channel: str) -> ColumnElement[bool]:
    """A rollout of the channel. One graded without any call logged has no channel: it is counted
    under rft (as the runs' counts read it), so it is found there too."""
    if channel == "rft":
        return or_(RolloutRow.channel == channel, RolloutRow.channel.is_(None))
    return RolloutRow.channel == channel


class ReviewRepository(Queries):
    """The queries of the rollout list, the runs, the graders and the export."""

    async def run_scores(self, runs: Sequence[str], windows: int) -> list[RunScoreRow]:
        """Per run, window of its rollouts (in start order) and grader: the latest grades' count and sum."""
        if not runs:
            return []
        latest = aliased(Grade)
        newest = select(func.max(latest.id)).where(latest.trace_id == RolloutRow.trace_id)
        window = func.ntile(windows).over(
            partition_by=RolloutRow.run, order_by=(RolloutRow.first_seen, RolloutRow.trace_id)
        )
        scored = (
            select(
                RolloutRow.run.label("run"),
                (window - 1).label("window"),
                Grade.grader.label("grader"),
                Grade.score.label("score"),
            )
            .join(Grade, Grade.id == newest.correlate(RolloutRow).scalar_subquery())
            .where(RolloutRow.run.in_(list(runs)))
            .subquery("scored")
        )
        result = await self.session.execute(
            select(
                scored.c.run,
                scored.c.window,
                scored.c.grader,
                func.count(scored.c.score),
                func.sum(scored.c.score),
            ).group_by(scored.c.run, scored.c.window, scored.c.grader)
        )
        return [
            RunScoreRow(str(r[0]), int(r[1]), str(r[2]), int(r[3]), float(r[4] or 0.0)) for r in result.all()
        ]

    # --- lists ---------------------------------------------------------------------------------------

    async def runs(self, limit: int = 500, channel: str | None = None) -> list[RunRow]:
        """Run labels, most recent first, with their rollouts per channel (`channel`: that channel's only)."""
        query = select(
            RolloutRow.run,
            RolloutRow.channel,
            func.count(),
            func.min(RolloutRow.first_seen),
            func.max(RolloutRow.last_seen),
        ).group_by(RolloutRow.run, RolloutRow.channel)
        if channel is not None:
            query = query.where(_in_channel(channel))
        runs: dict[str | None, RunRow] = {}
        for run, kind, count, first, last in (await self.session.execute(query)).all():
            row = runs.get(run)
            if row is None:
                row = runs[run] = RunRow(run=run, rollouts=0, first_seen=first, last_seen=last, channels={})
            row.channels[kind or "rft"] = row.channels.get(kind or "rft", 0) + int(count)
            runs[run] = replace(
                row,
                rollouts=row.rollouts + int(count),
                first_seen=min(row.first_seen, first),
                last_seen=max(row.last_seen, last),
            )
        return sorted(runs.values(), key=lambda r: r.last_seen, reverse=True)[:limit]

    async def rollouts(
        self,
        filters: RolloutFilter,
        *,
        limit: int,
        before: tuple[Any, str] | None = None,
        sort: str = "time",
        descending: bool = True,
    ) -> list[ListedRollout]:
        """Keyset-paginated on (sort key, trace_id): deep pages cost what the first does.

        `before` is the (key, trace_id) of the previous page's last row (`ListedRollout.key`).
        """
        key = self.sort_key(sort)
        query = (
            select(RolloutRow, Grade, key, RolloutLabel.label)
            .select_from(RolloutRow)
            .outerjoin(Grade, Grade.id == self._latest_grade_id(filters.grader))
            .outerjoin(RolloutLabel, RolloutLabel.trace_id == RolloutRow.trace_id)
            .order_by(
                *((key.desc(), RolloutRow.trace_id.desc()) if descending else (key, RolloutRow.trace_id))
            )
            .limit(limit)
        )
        query = query.where(*self._conditions(filters))
        if before is not None:
            position = tuple_(key, RolloutRow.trace_id)
            query = query.where(position < tuple_(*before) if descending else position > tuple_(*before))
        result = await self.session.execute(query)
        # rollouts.calls counts the calls as read (app/db/call_log.py), kept by the log writer.
        return [
            ListedRollout(rollout=r[0], call_count=r[0].calls, grade=r[1], key=r[2], label=r[3])
            for r in result.all()
        ]

    async def count_rollouts(self, filters: RolloutFilter) -> int:
        """How many rollouts the filters match (the same join and conditions as `rollouts`)."""
        query = (
            select(func.count())
            .select_from(RolloutRow)
            .outerjoin(Grade, Grade.id == self._latest_grade_id(filters.grader))
            .where(*self._conditions(filters))
        )
        return int(await self.session.scalar(query) or 0)

    async def score_summary(self, filters: RolloutFilter) -> ItemRow | None:
        """Latest scores of the rollouts the filters match: count, mean, mean square, min, max."""
        query = (
            select(
                func.count(Grade.score),
                func.avg(Grade.score),
                func.avg(Grade.score * Grade.score),
                func.min(Grade.score),
                func.max(Grade.score),
            )
            .select_from(RolloutRow)
            .join(Grade, Grade.id == self._latest_grade_id(filters.grader))
            .where(*self._conditions(filters))
        )
        row = (await self.session.execute(query)).one()
        if not row[0]:
            return None
        return ItemRow(
            item_key=filters.item_key,
            rollouts=int(row[0]),
            mean=float(row[1]),
            mean_square=float(row[2]),
            min=float(row[3]),
            max=float(row[4]),
        )

    def sort_key(self, sort: str) -> ColumnElement[Any]:
        if sort == "score":
            return func.coalesce(Grade.score, NO_SCORE)
        if sort == "calls":
            return RolloutRow.__table__.c.calls
        if sort == "duration":  # seconds from the rollout's first call to its last
            if self.dialect == "postgresql":
                return cast(func.extract("epoch", RolloutRow.last_seen - RolloutRow.first_seen), Float)
            return self._epoch(RolloutRow.last_seen) - self._epoch(RolloutRow.first_seen)
        return RolloutRow.__table__.c.last_seen

    def _answer_text(self) -> ColumnElement[Any]:
        """The grade's final answer as `final_answer` reads it: output_text, else the last message's text."""
        if self.dialect == "postgresql":
            last = Grade.sample[("choices", -1, "message", "content")].as_string()
        else:  # SQLite counts from the end with #-1
            last = type_coerce(func.json_extract(Grade.sample, "$.choices[#-1].message.content"), Text)
        return func.coalesce(Grade.sample["output_text"].as_string(), last)

    async def graders(self, run: str | None = None) -> list[GraderRow]:
        """Graders that graded the run's rollouts (every rollout when run is None), most rollouts first."""
        rollouts = func.count(func.distinct(Grade.trace_id))
        query = select(Grade.grader, rollouts).group_by(Grade.grader).order_by(rollouts.desc(), Grade.grader)
        if run is not None:
            query = query.join(RolloutRow, RolloutRow.trace_id == Grade.trace_id).where(RolloutRow.run == run)
        result = await self.session.execute(query)
        return [GraderRow(grader=r[0], rollouts=int(r[1])) for r in result.all()]

    def _latest_grade_id(self, grader: str | None) -> Any:
        latest = aliased(Grade)
        query = select(func.max(latest.id)).where(latest.trace_id == RolloutRow.trace_id)
        if grader is not None:
            query = query.where(latest.grader == grader)
        return query.correlate(RolloutRow).scalar_subquery()

    def _conditions(self, f: RolloutFilter) -> list[ColumnElement[bool]]:
        conditions: list[ColumnElement[bool]] = []
        if f.run is not None:
            conditions.append(RolloutRow.run == f.run)
        if f.channel is not None:
            conditions.append(_in_channel(f.channel))
        if f.item_key is not None:
            # "item-7" finds "id:item-7": the key's field prefix is optional.
            # A rollout belongs to an item by its own key, or by the key of any of its grades.
            graded = aliased(Grade)
            suffix = f":{f.item_key}"
            conditions.append(
                or_(
                    RolloutRow.item_key == f.item_key,
                    self._ends_with(RolloutRow.item_key, suffix),
                    exists().where(
                        graded.trace_id == RolloutRow.trace_id,
                        or_(graded.item_key == f.item_key, self._ends_with(graded.item_key, suffix)),
                    ),
                )
            )
        if f.q is not None:
            searched = (RolloutRow.trace_id, RolloutRow.item_key, self._answer_text())
            conditions.append(or_(*(self._contains_ignoring_case(column, f.q) for column in searched)))
        if f.min_score is not None:
            conditions.append(Grade.score >= f.min_score)
        if f.max_score is not None:
            conditions.append(Grade.score <= f.max_score)
        if f.flag is not None:
            conditions.append(self._has_flag(f.flag))
        if f.tool is not None:
            conditions.append(
                RolloutRow.trace_id.in_(select(ToolCall.trace_id).where(ToolCall.tool == f.tool))
            )
        if f.since is not None:
            conditions.append(RolloutRow.last_seen >= f.since)
        if f.until is not None:
            conditions.append(RolloutRow.last_seen < f.until)
        if f.label is not None:
            # Aliased: the rollout list joins the label table itself.
            label = aliased(RolloutLabel)
            labelled = select(label.trace_id).where(label.trace_id == RolloutRow.trace_id)
            if f.label == "unlabelled":
                conditions.append(~labelled.exists())
            else:
                conditions.append(labelled.where(label.label == f.label).exists())
        if f.status == "ungraded":
            conditions.append(Grade.id.is_(None))
        elif f.status is not None:
            conditions.append(Grade.status == f.status)
        return conditions

    def _ends_with(self, column: Any, suffix: str) -> ColumnElement[bool]:
        ends: ColumnElement[bool] = column.endswith(suffix, autoescape=True)
        if self.dialect == "postgresql":
            return ends
        # SQLite's LIKE ignores the case of ASCII letters: item "Abc" is not item "abc" (as on Postgres).
        return and_(ends, func.substr(column, -len(suffix)) == suffix)

    def _contains_ignoring_case(self, column: Any, text: str) -> ColumnElement[bool]:
        if self.dialect == "postgresql":
            found: ColumnElement[bool] = column.icontains(text, autoescape=True)
            return found
        # SQLite's lower() folds ASCII only: "école" would miss "ÉCOLE" (app/db/session.py).
        lowered: ColumnElement[str] = getattr(func, UNICODE_LOWER)(column, type_=Text)
        return lowered.contains(text.lower(), autoescape=True)

    def _has_flag(self, name: str) -> ColumnElement[bool]:
        if self.dialect == "postgresql":
            # JSONB containment; a GIN index on grades.flags would serve it if flag filters get hot.
            probe = cast(literal(orjson.dumps([{"name": name}]).decode()), JSONB)
            return Grade.flags.op("@>")(probe)
        element = func.json_each(Grade.flags).table_valued("value")
        return exists(
            select(literal(1))
            .select_from(element)
            .where(func.json_extract(element.c.value, "$.name") == name)
        )

    async def grade_ids_for_run(self, run: str) -> list[str]:
        """Trace ids of the run's graded rollouts (for recomputing their flags)."""
        result = await self.session.scalars(
            select(RolloutRow.trace_id)
            .where(RolloutRow.run == run, exists().where(Grade.trace_id == RolloutRow.trace_id))
            .order_by(RolloutRow.trace_id)
        )
        return list(result.all())

    # --- export ----------------------------------------------------------------------------------------

    async def export_batches(
        self, run: str | None, *, batch_size: int = 200
    ) -> AsyncIterator[list[tuple[RolloutRow, list[Row[Any]], list[Grade], RolloutLabel | None]]]:
        """The run's rollouts in trace_id order with their calls, grades and label, a batch at a time."""
        after: str | None = None
        while True:
            query = select(RolloutRow).order_by(RolloutRow.trace_id).limit(batch_size)
            if run is not None:
                query = query.where(RolloutRow.run == run)
            if after is not None:
                query = query.where(RolloutRow.trace_id > after)
            rollouts = list((await self.session.scalars(query)).all())
            if not rollouts:
                return
            ids = [r.trace_id for r in rollouts]
            since, until = min(r.first_seen for r in rollouts), max(r.last_seen for r in rollouts)
            calls = (
                await self.session.execute(logged_calls(ToolCall.trace_id.in_(ids), since=since, until=until))
            ).all()
            grades = (
                await self.session.scalars(
                    select(Grade).where(Grade.trace_id.in_(ids)).order_by(Grade.created_at, Grade.id)
                )
            ).all()
            calls_by: dict[str, list[Row[Any]]] = {i: [] for i in ids}
            grades_by: dict[str, list[Grade]] = {i: [] for i in ids}
            for call in calls:
                calls_by[call.trace_id].append(call)
            for grade in grades:
                if grade.trace_id is not None:
                    grades_by[grade.trace_id].append(grade)
            labels = {
                row.trace_id: row
                for row in (
                    await self.session.scalars(select(RolloutLabel).where(RolloutLabel.trace_id.in_(ids)))
                ).all()
            }
            yield [(r, calls_by[r.trace_id], grades_by[r.trace_id], labels.get(r.trace_id)) for r in rollouts]
            after = ids[-1]
            self.session.expunge_all()  # keep memory flat over a long export
