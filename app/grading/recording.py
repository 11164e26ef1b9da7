"""A stored grade: the one place that builds its row and raises its review flags."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, TypedDict, Unpack

from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import Grade
from app.grading.flags import DEFAULT_POLICY, Flag, FlagPolicy, compute_flags
from app.grading.repository import GradeRepository
from app.grounding import answer_hash, final_answer
from app.rollouts.identity import item_key
from app.rollouts.repository import RolloutRepository
from app.rollouts.shapes import RolloutCall


class GradeFields(TypedDict):
    """What a stored grade records besides its flags (the answer's hash and the item key are derived)."""

    trace_id: str | None
    grader: str
    grader_version: str
    status: str
    score: float | None
    sub_scores: Mapping[str, float]
    errors: Sequence[Any]
    sample: Mapping[str, Any]
    item: Mapping[str, Any]
    run: str | None
    latency_ms: float
    created_at: datetime


def grade_row(*, flags: Sequence[Mapping[str, Any]], **fields: Unpack[GradeFields]) -> dict[str, Any]:
    """The columns of a stored grade (`Grade(**row)`, or a row for a bulk insert)."""
    answer = final_answer(fields["sample"])
    return {
        **fields,
        "sub_scores": dict(fields["sub_scores"]),
        "flags": [dict(flag) for flag in flags],
        "errors": list(fields["errors"]),
        "sample": dict(fields["sample"]),
        "item": dict(fields["item"]),
        "answer_hash": answer_hash(answer) if answer.strip() else None,
        "item_key": item_key(fields["item"]),
    }


async def review_flags(
    grades: GradeRepository,
    *,
    calls: Sequence[RolloutCall] | None,
    answer: str,
    score: float | None,
    status: str,
    errors: Sequence[str] = (),
    item_key: str | None,
    extra_sources: Sequence[str] = (),
    policy: FlagPolicy = DEFAULT_POLICY,
) -> list[Flag]:
    """The review flags of a grade (at grade time, or recomputed from what is stored)."""
    same = 0
    if item_key is not None and answer.strip():
        same = await grades.items_with_same_answer(answer_hash(answer), exclude_item=item_key)
    return compute_flags(
        calls,
        answer=answer,
        score=score,
        status=status,
        errors=errors,
        same_answer_items=same,
        extra_sources=extra_sources,
        policy=policy,
    )


async def store_grade(
    session: AsyncSession,
    *,
    calls: Sequence[RolloutCall] | None,
    grader_flags: Sequence[Mapping[str, Any]] = (),
    extra_sources: Sequence[str] = (),
    policy: FlagPolicy = DEFAULT_POLICY,
    **fields: Unpack[GradeFields],
) -> tuple[Grade, list[Flag]]:
    """Add a grade with its review flags and mark its rollout graded (in the caller's transaction).

    `calls` are the rollout's logged calls (None when the grade has no trace). Returns the grade and
    the review flags it raised (the grader's own flags come first in the stored list).
    """
    key = item_key(fields["item"])
    raised = await review_flags(
        GradeRepository(session),
        calls=calls,
        answer=final_answer(fields["sample"]),
        score=fields["score"],
        status=fields["status"],
        errors=[str(error) for error in fields["errors"]],
        item_key=key,
        extra_sources=extra_sources,
        policy=policy,
    )
    grade = Grade(**grade_row(flags=[*grader_flags, *(flag.as_json() for flag in raised)], **fields))
    GradeRepository(session).add(grade)
    if trace_id := fields["trace_id"]:
        await RolloutRepository(session).mark_graded(
            trace_id, at=fields["created_at"], run=fields["run"], item_key=key
        )
    return grade, raised
