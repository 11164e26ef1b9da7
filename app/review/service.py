"""Reading rollouts for review: the filtered list, one rollout with its grades, what it was graded on, flags
recomputed on demand, the export. Run statistics are in app/review/statistics.py."""

from __future__ import annotations

import base64
import binascii
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Grade, RolloutLabel, RolloutRow
from app.db.text import has_control_character
from app.errors import BadRequest, NotFound
from app.grading.flags import DEFAULT_POLICY, FLAG_NAMES, FlagPolicy, answer_hash, final_answer
from app.grading.recording import review_flags
from app.grading.repository import GradeRepository
from app.grounding import last_message
from app.review import schemas as s
from app.review.repository import ReviewRepository, RolloutFilter, RunScoreRow
from app.review.statistics import item_stats_of
from app.rollouts.repository import RolloutRepository
from app.rollouts.shapes import FlagOut, GradeOut, RolloutDetail, RolloutSummary, TranscriptOut
from app.rollouts.timeline import LoggedCall, build_timeline, read_timeline, rollout_calls
from app.rollouts.transcripts import TranscriptRepository
from sparring.canaries import all_canaries
from sparring.wire import json_bytes


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
            # Compared as UTC (as the rows hold it): a time the calendar cannot hold in UTC is no cursor.
            moment = datetime.fromisoformat(raw[0])
            key: Any = (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).astimezone(UTC)
            trace_id = str(raw[1])
        else:
            if len(raw) != 3 or raw[0] != sort or isinstance(raw[1], bool):
                raise invalid
            key, trace_id = float(raw[1]), str(raw[2])
    except (
        binascii.Error,
        orjson.JSONDecodeError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        OverflowError,
    ) as exc:
        raise invalid from exc
    if has_control_character(trace_id):  # base64 hid it from the check of the query
        raise invalid
    return key, trace_id


def flags_of(grade: Grade) -> list[FlagOut]:
    """The grade's flags, each name once: a name raised twice (by the grader and by the review checks)
    keeps the first reason that has evidence, else the first, and the evidence of both."""
    out: dict[str, FlagOut] = {}
    for raw in grade.flags or []:
        if not (isinstance(raw, dict) and "name" in raw):
            continue
        name = str(raw["name"])
        evidence = [int(e) for e in raw.get("evidence") or [] if isinstance(e, int)]
        seen = out.get(name)
        if seen is None:
            out[name] = FlagOut(name=name, reason=str(raw.get("reason", "")), evidence=evidence)
            continue
        merged = seen.evidence + [e for e in evidence if e not in seen.evidence]
        reason = seen.reason if seen.evidence or not evidence else str(raw.get("reason", ""))
        out[name] = FlagOut(name=name, reason=reason, evidence=sorted(merged))
    return list(out.values())


def grade_out(grade: Grade) -> GradeOut:
    return GradeOut(
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


def export_record(
    rollout: RolloutRow,
    calls: Sequence[LoggedCall],
    grades: Sequence[Grade],
    label: RolloutLabel | None = None,
    transcript: TranscriptOut | None = None,
) -> dict[str, Any]:
    """One JSONL line of the export: the rollout, its calls in order, its grades, a person's label, its
    conversation."""
    return {
        "trace_id": rollout.trace_id,
        "run": rollout.run,
        "item_key": rollout.item_key,
        "first_seen": rollout.first_seen,
        "last_seen": rollout.last_seen,
        "graded_at": rollout.graded_at,
        "calls": [call.model_dump(exclude={"flags"}) for call in rollout_calls(calls)],
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
        "label": None
        if label is None
        else {
            "label": label.label,
            "note": label.note,
            "labelled_by": label.labelled_by,
            "labelled_at": label.labelled_at,
        },
        # The conversation (sparring.conversation's shape), when one was stored; else null.
        "conversation": transcript.model_dump(exclude={"size_bytes"}) if transcript is not None else None,
    }


RUNS_SUMMARISED = 200  # runs on the runs page


def _summary(run: s.RunOut, rows: Sequence[RunScoreRow], models: list[str], windows: int) -> s.RunSummary:
    by_grader: dict[str, int] = {}
    per_window: dict[int, tuple[int, float]] = {}
    for row in rows:
        by_grader[row.grader] = by_grader.get(row.grader, 0) + row.scored
        count, total = per_window.get(row.window, (0, 0.0))
        per_window[row.window] = (count + row.scored, total + row.total)
    scored = sum(count for count, _ in per_window.values())
    total = sum(value for _, value in per_window.values())
    graders = sorted(by_grader, key=lambda name: (-by_grader[name], name))
    return s.RunSummary(
        **run.model_dump(),
        scored=scored,
        reward_mean=total / scored if scored else None,
        grader=graders[0] if graders else None,
        graders=graders,
        models=models,
        reward_windows=[
            per_window[w][1] / per_window[w][0] if per_window.get(w, (0, 0.0))[0] else None
            for w in range(windows)
        ],
    )


def group_runs(runs: Sequence[s.RunSummary], canaries: set[str]) -> list[s.RunGroup]:
    """Each run alone, but the runs of one `sparring canary` (`<label>-<policy>`, with a canary's model or
    none recorded) together under their label, where the most recent of them stands."""
    groups: list[s.RunGroup] = []
    by_label: dict[str, s.RunGroup] = {}
    for run in runs:
        label, _, policy = (run.run or "").rpartition("-")
        is_canary = bool(label) and policy in canaries and all(m == f"canary:{policy}" for m in run.models)
        if not is_canary:
            groups.append(s.RunGroup(label=run.run, canary=False, runs=[run]))
            continue
        member = run.model_copy(update={"canary": policy})
        if label in by_label:
            by_label[label].runs.append(member)
        else:
            by_label[label] = s.RunGroup(label=label, canary=True, runs=[member])
            groups.append(by_label[label])
    return groups


class RolloutReview:
    def __init__(
        self,
        session: AsyncSession,
        policy: FlagPolicy = DEFAULT_POLICY,
    ) -> None:
        self.session = session
        self.repo = ReviewRepository(session)
        self.policy = policy

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
        calls = timeline.timeline if timeline is not None else []
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
            RolloutSummary(
                trace_id=row.rollout.trace_id,
                run=row.rollout.run,
                channel=row.rollout.channel,
                item_key=row.rollout.item_key or (row.grade.item_key if row.grade else None),
                first_seen=row.rollout.first_seen,
                last_seen=row.rollout.last_seen,
                graded_at=row.rollout.graded_at,
                call_count=row.call_count,
                grader=row.grade.grader if row.grade else None,
                status=row.grade.status if row.grade else None,
                score=row.grade.score if row.grade else None,
                flags=[f.name for f in flags_of(row.grade)] if row.grade else [],
                label=row.label,
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
        return item_stats_of(row) if row is not None else None

    async def graders(self, run: str | None = None) -> list[s.GraderOut]:
        return [s.GraderOut.model_validate(g, from_attributes=True) for g in await self.repo.graders(run)]

    async def runs(self, channel: str | None = None) -> list[s.RunOut]:
        return [
            s.RunOut.model_validate(r, from_attributes=True) for r in await self.repo.runs(channel=channel)
        ]

    async def run_groups(self, limit: int = RUNS_SUMMARISED, windows: int = 12) -> list[s.RunGroup]:
        """The most recent runs with their reward, grader, model and reward per window, a canary's runs
        grouped under its label."""
        runs = (await self.runs())[:limit]
        names = [r.run for r in runs if r.run]
        scores = await self.repo.run_scores(names, windows)
        models = await TranscriptRepository(self.session).models_of_runs(names)
        summaries = [
            _summary(r, [row for row in scores if row.run == r.run], models.get(r.run, []), windows)
            if r.run
            else s.RunSummary(**r.model_dump())
            for r in runs
        ]
        return group_runs(summaries, set(all_canaries()))

    async def detail(self, trace_id: str) -> RolloutDetail:
        """The rollout's calls in order (each with the flags citing it) and its grades; 404 if neither."""
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
        timeline = [
            call.model_copy(update={"flags": tuple(cited.get(call.seq, ()))}) for call in base.timeline
        ]
        transcript = await TranscriptRepository(self.session).get(trace_id)
        return base.model_copy(update={"timeline": timeline, "grades": graded, "transcript": transcript})

    # --- export ----------------------------------------------------------------------------------------

    async def export_lines(self, run: str | None) -> AsyncIterator[bytes]:
        transcripts = TranscriptRepository(self.session)
        async for batch in self.repo.export_batches(run):
            conversations = await transcripts.for_traces(rollout.trace_id for rollout, _, _, _ in batch)
            for rollout, calls, grades, label in batch:
                record = export_record(rollout, calls, grades, label, conversations.get(rollout.trace_id))
                yield _json_line(record)


def _json_line(record: dict[str, Any]) -> bytes:
    # A dataset row or a sample may hold an integer beyond 64 bits (Postgres' JSONB gives one back for a
    # number like 1e20): `json_bytes` writes it.
    return json_bytes(record) + b"\n"


def _output_tools(sample: dict[str, Any]) -> list[Any]:
    listed = sample.get("output_tools")
    if isinstance(listed, list) and listed:
        return listed
    calls = last_message(sample).get("tool_calls")
    return calls if isinstance(calls, list) else []
