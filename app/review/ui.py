"""Review web pages under /review: server-rendered HTML behind the login cookie. HTTP only."""

from __future__ import annotations

import contextlib
import importlib.resources
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from app.db.models import CHANNELS
from app.deps import RegistryDep, app_state
from app.errors import BadRequest, NotFound
from app.grading.flags import FLAG_NAMES
from app.review import charts
from app.review import formatting as fmt
from app.review import schemas as s
from app.review.conversation import conversation_view, file_changes, starting_files
from app.review.deps import (
    NEEDS_LOGIN,
    GraderAgreementDep,
    RolloutLabelsDep,
    RolloutLabelsWritingDep,
    RolloutReviewDep,
    RolloutReviewWritingDep,
    RunAuditDep,
    RunStatisticsDep,
)
from app.review.flag_help import flag_help
from app.review.repository import SORTS, RolloutFilter
from app.review.session import end_session, has_session, is_admin_key, require_same_origin, start_session

router = APIRouter(prefix="/review", include_in_schema=False)
# Every page but the login's needs a logged-in browser (else a redirect to the login, and back).
pages = APIRouter(prefix="/review", include_in_schema=False, dependencies=NEEDS_LOGIN)

# Tool outputs are untrusted text: everything is autoescaped, and no script may run on these pages.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
PAGE_SIZE = 50
SORT_LABELS = {"time": "last seen", "score": "score", "calls": "tool calls", "duration": "duration"}
ITEMS_IN_CHART = 200
CURVE_WINDOWS = 20  # windows of the learning curve
CURVE_FLAGS = 6  # flags drawn per window (the most frequent)
SPARK_WINDOWS = 12  # points of each run's reward line on the runs page


@cache
def templates() -> Environment:
    env = Environment(
        loader=PackageLoader("app.review", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(pretty=fmt.pretty, when=fmt.when, score=fmt.score, ms=fmt.ms, pct=fmt.pct)
    env.filters.update(thousands=fmt.thousands, signed=fmt.signed, signed_pct=fmt.signed_pct)
    env.filters.update(json_text=fmt.json_text, content=fmt.content, tool_name=fmt.tool_name, size=fmt.size)
    env.globals.update(duration=fmt.duration, score_bar=charts.score_bar, score_band=charts.score_band)
    env.globals.update(flag_names=FLAG_NAMES, quote=quote, flag_help=flag_help)
    return env


def render(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    html = templates().get_template(name).render(request=request, **context)
    return HTMLResponse(html, status_code=status_code, headers=SECURITY_HEADERS)


def _safe_next(target: str | None) -> str:
    # Only our own pages: an absolute or protocol-relative URL would make the login an open redirect.
    if (
        target
        and (target.startswith("/review") or target == "/docs")
        and not target.startswith("//")
        and "\\" not in target
    ):
        return target
    return "/review"


def _blank(value: str | None) -> str | None:
    return value.strip() if value and value.strip() else None


def _chosen_grader(grader: str | None = None) -> str | None:
    """The grader picked on a page (blank: the latest grade of any grader)."""
    return _blank(grader)


ChosenGrader = Annotated[str | None, Depends(_chosen_grader)]


@router.get("/static/review.css")
async def stylesheet() -> Response:
    css = importlib.resources.files("app.review").joinpath("static/review.css").read_bytes()
    return Response(css, media_type="text/css", headers={"Cache-Control": "max-age=3600"})


@router.get("/login")
async def login_page(request: Request, next: str | None = None) -> Response:
    if await has_session(request):
        return RedirectResponse(_safe_next(next), status_code=303)
    return render(request, "login.html", next=_safe_next(next), error=None)


@router.post("/login")
async def login(
    request: Request, key: Annotated[str, Form()] = "", next: Annotated[str, Form()] = "/review"
) -> Response:
    require_same_origin(request)
    if not key or not is_admin_key(app_state(request.app).keyring, key.strip()):
        return render(
            request, "login.html", status_code=401, next=_safe_next(next), error="That is not an admin key."
        )
    response = RedirectResponse(_safe_next(next), status_code=303)
    start_session(request, response)
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    require_same_origin(request)
    response = RedirectResponse("/review/login", status_code=303)
    await end_session(request, response)
    return response


@dataclass
class RolloutForm:
    """The rollout list's filters as the page's form sends them: text, checked here (a bad number or
    date is reported on the page, not refused), blank fields meaning no filter."""

    run: str | None = None
    channel: str | None = None
    item: str | None = None
    min_score: str | None = None
    max_score: str | None = None
    flag: str | None = None
    tool: str | None = None
    since: str | None = None
    until: str | None = None
    status: str | None = None
    grader: str | None = None
    label: str | None = None
    q: str | None = None
    sort: str | None = None
    order: str | None = None
    cursor: str | None = None

    @property
    def sort_by(self) -> str:
        return self.sort if self.sort in SORTS else "time"

    def shown(self) -> dict[str, str]:
        """The form's fields as the page shows them again (the default sort and order left blank)."""
        fields = {name: getattr(self, name) or "" for name in FORM_FIELDS}
        fields["sort"] = self.sort_by if self.sort_by != "time" else ""
        fields["order"] = "asc" if self.order == "asc" else ""
        return fields

    def filters(self, errors: list[str]) -> RolloutFilter:
        return RolloutFilter(
            run=_blank(self.run),
            channel=_blank(self.channel) if _blank(self.channel) in CHANNELS else None,
            item_key=_blank(self.item),
            min_score=_number(self.min_score, "min score", errors),
            max_score=_number(self.max_score, "max score", errors),
            flag=_blank(self.flag),
            tool=_blank(self.tool),
            since=_moment(self.since, "since", errors),
            until=_moment(self.until, "until", errors),
            status=_blank(self.status) if _blank(self.status) in ("ok", "failed", "ungraded") else None,
            grader=_blank(self.grader),
            q=_blank(self.q),
            label=_blank(self.label) if _blank(self.label) in ("pass", "fail", "unlabelled") else None,
        )


# The form's fields shown again as typed (sort and order are shown by RolloutForm.shown).
FORM_FIELDS: tuple[str, ...] = (
    "q",
    "run",
    "channel",
    "item",
    "min_score",
    "max_score",
    "flag",
    "tool",
    "since",
    "until",
)
FORM_FIELDS += ("status", "grader", "label")


@pages.get("")
async def rollouts_page(
    request: Request, review: RolloutReviewDep, form: Annotated[RolloutForm, Depends()]
) -> Response:
    errors: list[str] = []
    filters = form.filters(errors)
    page = await review.rollouts(
        filters,
        limit=PAGE_SIZE,
        cursor=_blank(form.cursor),
        sort=form.sort_by,
        descending=form.order != "asc",
        count=True,
    )
    shown = form.shown()
    next_query = None
    if page.next_cursor:
        next_query = urlencode({**{k: v for k, v in shown.items() if v}, "cursor": page.next_cursor})
    return render(
        request,
        "rollouts.html",
        page=page,
        runs=await review.runs(),
        graders=await review.graders(filters.run),
        form=shown,
        errors=errors,
        next_query=next_query,
        item_scores=await review.score_summary(filters) if filters.item_key else None,
        sorts=SORT_LABELS,
        page_from=bool(_blank(form.cursor)),
    )


def _number(value: str | None, name: str, errors: list[str]) -> float | None:
    if not _blank(value):
        return None
    try:
        number = float(value or "")
    except ValueError:
        errors.append(f"{name} must be a number")
        return None
    return number if math.isfinite(number) else None


def _moment(value: str | None, name: str, errors: list[str]) -> datetime | None:
    if not _blank(value):
        return None
    try:
        moment = datetime.fromisoformat((value or "").strip())
    except ValueError:
        errors.append(f"{name} must be a date and time like 2026-12-02T18:00")
        return None
    try:
        return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).astimezone(UTC)
    except OverflowError:  # 0001-01-01T00:00+14:00: before the calendar once in UTC
        errors.append(f"{name} must be a date and time like 2026-12-02T18:00, within years 1 to 9999 in UTC")
        return None


@pages.get("/rollouts/{trace_id:trace}")
async def rollout_page(
    request: Request,
    trace_id: str,
    review: RolloutReviewDep,
    labels: RolloutLabelsDep,
    grader: ChosenGrader,
    registry: RegistryDep,
    queue: str | None = None,
) -> Response:
    try:
        timeline = await review.detail(trace_id)
        graded_on = await review.graded_on(trace_id, grader)
    except NotFound as exc:
        return render(request, "not_found.html", status_code=404, message=exc.message)
    queue = _blank(queue)
    following = await labels.next_in_queue(queue, grader, after=trace_id) if queue else None
    batches: list[list[Any]] = []
    for call in timeline.timeline:
        if not batches or batches[-1][0].batch != call.batch:
            batches.append([])
        batches[-1].append(call)
    starting = starting_files(registry, timeline.timeline, graded_on.item or {})
    return render(
        request,
        "rollout.html",
        timeline=timeline,
        batches=batches,
        conversation=conversation_view(timeline.transcript, timeline.timeline),
        files=file_changes(timeline.timeline, starting),
        graded_on=graded_on,
        item_fields=_item_fields(graded_on.item or {}),
        label=await labels.get(trace_id),
        queue=queue,
        queue_next=_queue_link(following, queue, grader) if following and queue else None,
    )


def _queue_link(trace_id: str, queue: str, grader: str | None) -> str:
    """A rollout's page as a step of a run's labelling queue."""
    query = urlencode({"queue": queue, **({"grader": grader} if grader else {})})
    return f"/review/rollouts/{quote(trace_id, safe='')}?{query}"


@pages.post("/rollouts/{trace_id:trace}/label")
async def label_page(
    request: Request,
    trace_id: str,
    labels: RolloutLabelsWritingDep,
    label: Annotated[str, Form()] = "",
    note: Annotated[str, Form(max_length=4000)] = "",
    queue: Annotated[str, Form()] = "",
    grader: Annotated[str, Form()] = "",
) -> Response:
    """Label (pass, fail) or unlabel (remove) the rollout; then the queue's next rollout, or this one."""
    require_same_origin(request)
    if label == "remove":
        with contextlib.suppress(NotFound):
            await labels.delete(trace_id)
    elif label in ("pass", "fail"):
        await labels.put(trace_id, s.LabelIn(label=label, note=note), by="session")
    else:
        raise BadRequest("label must be pass, fail or remove")
    chosen = _blank(grader)
    if _blank(queue):
        following = await labels.next_in_queue(queue.strip(), chosen, after=trace_id)
        if following is not None:
            return RedirectResponse(_queue_link(following, queue.strip(), chosen), status_code=303)
        return RedirectResponse(f"/review/runs/{quote(queue.strip(), safe='')}/queue", status_code=303)
    return RedirectResponse(f"/review/rollouts/{quote(trace_id, safe='')}", status_code=303)


@pages.get("/runs/{run:path}/queue")
async def queue_page(request: Request, run: str, labels: RolloutLabelsDep, chosen: ChosenGrader) -> Response:
    queue = await labels.queue(run, chosen, limit=PAGE_SIZE)
    first = _queue_link(queue.rollouts[0].trace_id, run, chosen) if queue.rollouts else None
    return render(request, "queue.html", queue=queue, first=first, link=lambda t: _queue_link(t, run, chosen))


# Dataset row fields shown first: the prompt, then what the answer is checked against.
PROMPT_FIELDS = ("messages", "input", "prompt", "question")
REFERENCE_HINTS = ("reference", "gold", "expected", "answer", "ground_truth", "label", "target", "solution")


@dataclass(frozen=True)
class ItemField:
    name: str
    kind: str  # messages | tools | text | json
    value: Any


def _item_fields(item: dict[str, Any]) -> list[ItemField]:
    """The dataset row's fields in reading order: prompt messages, tools, reference fields, the rest."""

    def rank(name: str) -> tuple[int, str]:
        if name in PROMPT_FIELDS:
            return (0, name)
        if name == "tools":
            return (1, name)
        if any(hint in name.lower() for hint in REFERENCE_HINTS):
            return (2, name)
        return (3, name)

    fields = []
    for name in sorted(item, key=rank):
        value = item[name]
        if fmt.is_messages(value):
            fields.append(ItemField(name, "messages", value))
        elif name == "tools" and isinstance(value, list):
            fields.append(ItemField(name, "tools", value))
        elif isinstance(value, str):
            fields.append(ItemField(name, "text", value))
        else:
            fields.append(ItemField(name, "json", fmt.json_text(value)))
    return fields


@pages.post("/rollouts/{trace_id:trace}/recompute-flags")
async def recompute_page(trace_id: str, review: RolloutReviewWritingDep) -> Response:
    await review.recompute_flags(trace_id)
    return RedirectResponse(f"/review/rollouts/{quote(trace_id)}", status_code=303)


@pages.get("/runs")
async def runs_page(request: Request, review: RolloutReviewDep) -> Response:
    return render(
        request,
        "runs.html",
        groups=await review.run_groups(windows=SPARK_WINDOWS),
        sparkline=charts.sparkline,
        windows=SPARK_WINDOWS,
    )


@pages.get("/run")
async def run_page(
    request: Request,
    review: RolloutReviewDep,
    statistics: RunStatisticsDep,
    audits: RunAuditDep,
    name: Annotated[str, Query()],
    chosen: ChosenGrader,
    axis: str | None = None,
) -> Response:
    stats = await statistics.run_stats(name, chosen)
    items = await statistics.item_stats(name, chosen, order="mean", limit=ITEMS_IN_CHART)
    curve_axis = "order" if axis == "order" else "time"
    curve = await statistics.reward_curve(name, chosen, axis=curve_axis, windows=CURVE_WINDOWS)
    points = [charts.ItemPoint(i.item_key or "(none)", i.mean, i.std, i.rollouts) for i in items.items]
    return render(
        request,
        "run.html",
        stats=stats,
        items=items,
        graders=await review.graders(name),
        grader=chosen or "",
        curve=curve,
        curve_charts=charts.curve_charts(curve, CURVE_WINDOWS, CURVE_FLAGS),
        charts=charts.run_charts(stats, points),
        items_capped=items.next_offset is not None,
        export_url=f"/export?{urlencode({'run': name})}",
        audit=await audits.audit(name, chosen),
    )


@pages.get("/compare")
async def compare_page(
    request: Request,
    review: RolloutReviewDep,
    statistics: RunStatisticsDep,
    chosen: ChosenGrader,
    a: str | None = None,
    b: str | None = None,
) -> Response:
    comparison = await statistics.compare(a, b, chosen) if a and b and _blank(a) and _blank(b) else None
    return render(
        request,
        "compare.html",
        compare_charts=charts.compare_charts(comparison) if comparison else None,
        runs=await review.runs(),
        graders=await review.graders(),
        grader=chosen or "",
        comparison=comparison,
        a=a or "",
        b=b or "",
    )


@pages.get("/flags")
async def flags_page(
    request: Request,
    review: RolloutReviewDep,
    statistics: RunStatisticsDep,
    chosen: ChosenGrader,
    run: str | None = None,
    flag: str | None = None,
) -> Response:
    flagged = None
    if _blank(flag):
        flagged = await review.rollouts(
            RolloutFilter(run=_blank(run), flag=_blank(flag), grader=chosen),
            limit=PAGE_SIZE,
            cursor=None,
            count=True,
        )
    return render(
        request,
        "flags.html",
        counts=await statistics.flag_counts(_blank(run), chosen),
        runs=await review.runs(),
        graders=await review.graders(_blank(run)),
        grader=chosen or "",
        run=run or "",
        flag=flag or "",
        flagged=flagged,
    )


SCATTER_POINTS = 2000  # rollouts drawn in the grader-vs-grader scatter


@pages.get("/runs/{run:path}/graders")
async def graders_page(
    request: Request,
    run: str,
    graders: GraderAgreementDep,
    threshold: str | None = None,
    a: str | None = None,
    b: str | None = None,
) -> Response:
    errors: list[str] = []
    cut = _number(threshold, "threshold", errors)
    cut = 0.5 if cut is None else cut
    scores = await graders.scores(run)
    figures = await graders.figures(run, cut, scores)
    pair = next(
        (p for p in figures.pairs if (p.a, p.b) == (a, b)), figures.pairs[0] if figures.pairs else None
    )
    scatter = None
    if pair is not None:
        both = sorted(set(scores[pair.a]) & set(scores[pair.b]))[:SCATTER_POINTS]
        points = [charts.PairPoint(t, scores[pair.a][t], scores[pair.b][t]) for t in both]
        scatter = charts.grader_scatter(pair.a, pair.b, points)
    return render(
        request, "graders.html", figures=figures, pair=pair, scatter=scatter, errors=errors, run=run
    )


@pages.get("/runs/{run:path}/audit")
async def audit_page(request: Request, run: str, audits: RunAuditDep, chosen: ChosenGrader) -> Response:
    return render(request, "audit.html", audit=await audits.audit(run, chosen))
