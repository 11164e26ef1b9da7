"""Review JSON API under /review/api (admin key or review session), and GET /export (JSONL). HTTP only."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Response
from fastapi.responses import StreamingResponse

from app.deps import Database, DatabaseDep
from app.errors import BadRequest, NotFound
from app.review import schemas as s
from app.review.deps import (
    GraderAgreementDep,
    RolloutLabelsDep,
    RolloutLabelsWritingDep,
    RolloutReviewDep,
    RolloutReviewWritingDep,
    RunAuditDep,
    RunStatisticsDep,
)
from app.review.repository import RolloutFilter
from app.review.service import RolloutReview
from app.review.session import require_review_access
from app.rollouts.shapes import RolloutDetail

ReviewAccess = Annotated[str, Depends(require_review_access)]

router = APIRouter(prefix="/review/api", tags=["review"])
export_router = APIRouter(tags=["review"])
# The machines' paths to the same reads: `GET /rollouts` is the rollout list, `GET /rollouts/{trace_id}`
# the same detail (the state of a rollout, `/rollouts/{trace_id}/state`, is in app/rollouts/routes.py).
rollouts_router = APIRouter(prefix="/rollouts", tags=["rollouts"])

GraderQuery = Annotated[str | None, Query(description="Count the latest grade of this grader only.")]


@dataclass(frozen=True)
class RunScope:
    """What a run's statistics count: the run's rollouts, scored by the latest grade (of `grader`)."""

    run: str
    grader: str | None


def run_scope(
    run: Annotated[str, Query(description="Run label (the X-Sparring-Run header).")],
    grader: GraderQuery = None,
) -> RunScope:
    return RunScope(run, grader)


RunScopeDep = Annotated[RunScope, Depends(run_scope)]
ItemOrder = Literal["mean", "variance", "rollouts", "item"]
RolloutSort = Literal["time", "score", "calls", "duration"]


# A finite number: NaN matches no score on SQLite and every score on Postgres.
ScoreBound = Annotated[float | None, Query(allow_inf_nan=False)]
ChannelQuery = Annotated[
    Literal["rft", "mcp"] | None,
    Query(description="rft: calls to the tool routes (training); mcp: calls over MCP (production, local)."),
]


@router.get("/runs")
async def list_runs(
    _: ReviewAccess, review: RolloutReviewDep, channel: ChannelQuery = None
) -> list[s.RunOut]:
    """Run labels (from the X-Sparring-Run header) with their rollouts per channel, most recent first."""
    return await review.runs(channel)


@router.get("/rollouts")
@rollouts_router.get("")
async def list_rollouts(
    _: ReviewAccess,
    review: RolloutReviewDep,
    run: str | None = None,
    channel: ChannelQuery = None,
    item: str | None = None,
    min_score: ScoreBound = None,
    max_score: ScoreBound = None,
    flag: str | None = None,
    tool: Annotated[str | None, Query(description="Rollouts that called this tool.")] = None,
    since: Annotated[datetime | None, Query(description="last_seen at or after (ISO 8601).")] = None,
    until: Annotated[datetime | None, Query(description="last_seen before (ISO 8601).")] = None,
    grader: GraderQuery = None,
    status: Literal["ok", "failed", "ungraded"] | None = None,
    label: Annotated[
        Literal["pass", "fail", "unlabelled"] | None, Query(description="A person's label, or none yet.")
    ] = None,
    q: Annotated[
        str | None, Query(max_length=200, description="A fragment of the trace id, item key or answer.")
    ] = None,
    sort: Annotated[RolloutSort, Query(description="time (last_seen), score, calls or duration.")] = "time",
    order: Literal["desc", "asc"] = "desc",
    count: Annotated[bool, Query(description="Also count every rollout that matches (total).")] = False,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(description="next_cursor of the previous page.")] = None,
) -> s.RolloutPage:
    """Rollouts (newest first by default) with their latest grade's score and flags."""
    filters = RolloutFilter(
        run=run,
        channel=channel,
        item_key=item,
        min_score=min_score,
        max_score=max_score,
        flag=flag,
        tool=tool,
        since=_utc(since),
        until=_utc(until),
        grader=grader,
        status=status,
        q=q.strip() if q and q.strip() else None,
        label=label,
    )
    return await review.rollouts(
        filters, limit=limit, cursor=cursor, sort=sort, descending=order == "desc", count=count
    )


@router.get("/graders")
async def list_graders(
    _: ReviewAccess, review: RolloutReviewDep, run: str | None = None
) -> list[s.GraderOut]:
    """Graders that graded the run's rollouts (or any rollout), most rollouts first."""
    return await review.graders(run)


@router.get("/rollouts/{trace_id:trace}/graded-on")
async def rollout_graded_on(
    trace_id: str, _: ReviewAccess, review: RolloutReviewDep, grader: GraderQuery = None
) -> s.GradedOn:
    """The dataset row and the sample the rollout's latest grade was given, and its item's statistics."""
    return await review.graded_on(trace_id, grader)


@router.post("/rollouts/{trace_id:trace}/recompute-flags")
async def recompute_flags(
    trace_id: str, _: ReviewAccess, review: RolloutReviewWritingDep
) -> s.RecomputedFlags:
    """Recompute the review flags of the rollout's grades from the stored calls and answers."""
    await review.recompute_flags(trace_id)
    return s.RecomputedFlags(trace_id=trace_id, grades=(await review.detail(trace_id)).grades)


@router.get("/rollouts/{trace_id:trace}/label")
async def get_label(trace_id: str, _: ReviewAccess, labels: RolloutLabelsDep) -> s.LabelOut:
    """The rollout's label (404 when nobody labelled it)."""
    label = await labels.get(trace_id)
    if label is None:
        raise NotFound(f"rollout {trace_id!r} has no label")
    return label


@router.put("/rollouts/{trace_id:trace}/label")
async def put_label(
    trace_id: str, body: s.LabelIn, access: ReviewAccess, labels: RolloutLabelsWritingDep
) -> s.LabelOut:
    """Label the rollout pass or fail, with an optional note (replaces an earlier label)."""
    return await labels.put(trace_id, body, by=access)


@router.delete("/rollouts/{trace_id:trace}/label", status_code=204)
async def delete_label(trace_id: str, _: ReviewAccess, labels: RolloutLabelsWritingDep) -> Response:
    """Remove the rollout's label (404 when it has none)."""
    await labels.delete(trace_id)
    return Response(status_code=204)


# After the routes under a rollout: a trace id may hold "/" (app/review/deps.py).
@router.get("/rollouts/{trace_id:trace}")
@rollouts_router.get("/{trace_id:trace}")
async def rollout_detail(trace_id: str, _: ReviewAccess, review: RolloutReviewDep) -> RolloutDetail:
    """Calls in order with their parallel batch, and every grade with sub-scores and flags."""
    return await review.detail(trace_id)


@router.get("/runs/{run:path}/queue")
async def label_queue(
    run: str,
    _: ReviewAccess,
    labels: RolloutLabelsDep,
    grader: GraderQuery = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> s.LabelQueue:
    """The run's next rollouts to label: unlabelled, stratified over score bands and items."""
    return await labels.queue(run, grader, limit=limit)


ThresholdQuery = Annotated[float, Query(ge=-1e9, le=1e9, description='A score at or above it is a "pass".')]


@router.get("/runs/{run:path}/agreement")
async def agreement(
    run: str, _: ReviewAccess, graders: GraderAgreementDep, threshold: ThresholdQuery = 0.5
) -> s.Agreement:
    """Every pair of graders that scored the same rollouts of the run, and every grader against the
    labels: n, agreement at the threshold, Cohen's kappa, Spearman (pairs), precision and recall of
    "pass" (labels), and the rollouts they disagree on; undefined statistics are null."""
    return await graders.figures(run, threshold)


@router.get("/runs/{run:path}/audit")
async def audit(run: str, _: ReviewAccess, audits: RunAuditDep, grader: GraderQuery = None) -> s.Audit:
    """Signals of reward hacking over the order the run's rollouts arrived in, each with the rollouts to
    open; `fired` names those past their thresholds (settings SPARRING_AUDIT_*)."""
    return await audits.audit(run, grader)


@router.get("/stats")
async def run_stats(_: ReviewAccess, stats: RunStatisticsDep, scope: RunScopeDep) -> s.RunStats:
    """A run's calls, tools, latencies, errors, rewards, items and flags, aggregated in the database."""
    return await stats.run_stats(scope.run, scope.grader)


@router.get("/curve")
async def reward_curve(
    _: ReviewAccess,
    stats: RunStatisticsDep,
    scope: RunScopeDep,
    axis: Annotated[
        Literal["time", "order"], Query(description="Equal spans of time, or equal numbers of rollouts.")
    ] = "time",
    windows: Annotated[int, Query(ge=1, le=200)] = 20,
) -> s.RewardCurve:
    """The learning curve: reward mean and spread, calls per rollout, tool errors and flags per window."""
    return await stats.reward_curve(scope.run, scope.grader, axis=axis, windows=windows)


@router.get("/items")
async def item_stats(
    _: ReviewAccess,
    stats: RunStatisticsDep,
    scope: RunScopeDep,
    order: ItemOrder = "mean",
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,  # OFFSET and LIMIT are 64-bit integers
) -> s.ItemStatsPage:
    """Per item across its rollouts: mean, variance, always 0 / always 1 (no learning signal)."""
    return await stats.item_stats(scope.run, scope.grader, order=order, limit=limit, offset=offset)


@router.get("/compare")
async def compare_runs(
    _: ReviewAccess,
    stats: RunStatisticsDep,
    a: Annotated[str, Query(description="Baseline run label.")],
    b: Annotated[str, Query(description="Run compared with the baseline.")],
    grader: GraderQuery = None,
) -> s.RunComparison:
    """Two runs side by side (b minus a): reward, calls per rollout, latency, tool mix, items."""
    return await stats.compare(a, b, grader)


@router.get("/flags")
async def flag_counts(
    _: ReviewAccess, stats: RunStatisticsDep, run: str | None = None, grader: GraderQuery = None
) -> list[s.FlagCount]:
    """Rollouts per flag (latest grade of each rollout)."""
    return await stats.flag_counts(run, grader)


@export_router.get(
    "/export",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": "One rollout per line."}},
)
async def export_rollouts(
    _: ReviewAccess,
    db: DatabaseDep,
    run: Annotated[str | None, Query(description="Run label; omit to export every rollout.")] = None,
) -> StreamingResponse:
    """Stream rollouts as JSONL, one per line with its calls and grades (same format as `sparring export`)."""
    lines = _export_lines(db, run)
    # Read the first batch before answering: an outage is then a 503, not a 200 cut short.
    first = await anext(lines, None)

    async def body() -> AsyncIterator[bytes]:
        if first is not None:
            yield first
        async for line in lines:
            yield line

    return StreamingResponse(
        body(),
        media_type="application/x-ndjson",
        headers={"Content-Disposition": _attachment(f"sparring-{run or 'all'}.jsonl")},
    )


def _utc(moment: datetime | None) -> datetime | None:
    """A time without a timezone is UTC, as on the review pages; one the calendar cannot hold in UTC
    (0001-01-01T00:00+14:00) is a 400."""
    if moment is None:
        return None
    try:
        return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).astimezone(UTC)
    except OverflowError as exc:
        raise BadRequest(f"{moment.isoformat()} is out of range in UTC") from exc


def _attachment(filename: str) -> str:
    """RFC 6266: an ASCII `filename` for old clients and the exact name, UTF-8, as `filename*`."""
    fallback = "".join(c if c.isascii() and c.isprintable() and c not in '"\\;' else "_" for c in filename)
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"


async def _export_lines(db: Database, run: str | None) -> AsyncIterator[bytes]:
    async with db.session() as session:
        async for line in RolloutReview(session).export_lines(run):
            yield line
