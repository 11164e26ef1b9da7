"""Review web pages under /review: server-rendered HTML behind the login cookie. HTTP only."""

from __future__ import annotations

import importlib.resources
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from typing import Annotated, Any
from urllib.parse import quote, urlencode

import orjson
from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from app.db.models import CHANNELS
from app.deps import DatabaseDep, app_state
from app.errors import NotFound
from app.grading.flags import FLAG_NAMES
from app.review import charts
from app.review.flag_help import flag_help
from app.review.repository import SORTS, RolloutFilter
from app.review.schemas import CurveWindow, RewardCurve, RunComparison, RunStats
from app.review.service import ReviewService
from app.review.session import end_session, has_session, is_admin_key, require_same_origin, start_session

router = APIRouter(prefix="/review", include_in_schema=False)

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


def _pretty(text: str | None) -> str:
    if not text:
        return ""
    try:
        return orjson.dumps(orjson.loads(text), option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONDecodeError:
        return text


def _when(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value else ""


def _score(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _ms(value: float | None) -> str:
    return "" if value is None else (f"{value:.0f}" if value >= 100 else f"{value:.3g}")


def _pct(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def _thousands(value: int | None) -> str:
    return "" if value is None else f"{value:,}"


def _duration(start: datetime | None, end: datetime | None) -> str:
    if start is None or end is None:
        return ""
    seconds = (end - start).total_seconds()
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"


@cache
def templates() -> Environment:
    env = Environment(
        loader=PackageLoader("app.review", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(pretty=_pretty, when=_when, score=_score, ms=_ms, pct=_pct, thousands=_thousands)
    env.filters.update(signed=_signed, signed_pct=_signed_pct)
    env.filters.update(json_text=_json_text, content=_content, tool_name=_tool_name, size=_size)
    env.globals.update(duration=_duration)
    env.globals.update(flag_names=FLAG_NAMES, quote=quote, flag_help=flag_help)
    return env


def render(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    html = templates().get_template(name).render(request=request, **context)
    return HTMLResponse(html, status_code=status_code, headers=SECURITY_HEADERS)


def _login_redirect(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/review/login?{urlencode({'next': target})}", status_code=303)


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


@router.get("")
async def rollouts_page(
    request: Request,
    db: DatabaseDep,
    run: str | None = None,
    channel: str | None = None,
    item: str | None = None,
    min_score: str | None = None,
    max_score: str | None = None,
    flag: str | None = None,
    tool: str | None = None,
    since: str | None = None,
    until: str | None = None,
    status: str | None = None,
    grader: str | None = None,
    q: str | None = None,
    sort: str | None = None,
    order: str | None = None,
    cursor: str | None = None,
) -> Response:
    if not await has_session(request):
        return _login_redirect(request)
    sort_by = sort if sort in SORTS else "time"
    descending = order != "asc"
    form = {
        "q": q or "",
        "run": run or "",
        "channel": channel or "",
        "item": item or "",
        "min_score": min_score or "",
        "max_score": max_score or "",
        "flag": flag or "",
        "tool": tool or "",
        "since": since or "",
        "until": until or "",
        "status": status or "",
        "grader": grader or "",
        "sort": sort_by if sort_by != "time" else "",
        "order": "" if descending else "asc",
    }
    errors: list[str] = []
    filters = RolloutFilter(
        run=_blank(run),
        channel=_blank(channel) if _blank(channel) in CHANNELS else None,
        item_key=_blank(item),
        min_score=_number(min_score, "min score", errors),
        max_score=_number(max_score, "max score", errors),
        flag=_blank(flag),
        tool=_blank(tool),
        since=_moment(since, "since", errors),
        until=_moment(until, "until", errors),
        status=_blank(status) if _blank(status) in ("ok", "failed", "ungraded") else None,
        grader=_blank(grader),
        q=_blank(q),
    )
    async with db.session() as session:
        service = ReviewService(session)
        page = await service.rollouts(
            filters,
            limit=PAGE_SIZE,
            cursor=_blank(cursor),
            sort=sort_by,
            descending=descending,
            count=True,
        )
        runs = await service.runs()
        graders = await service.graders(filters.run)
        item_scores = await service.score_summary(filters) if filters.item_key else None
    next_query = None
    if page.next_cursor:
        next_query = urlencode({**{k: v for k, v in form.items() if v}, "cursor": page.next_cursor})
    return render(
        request,
        "rollouts.html",
        page=page,
        runs=runs,
        graders=graders,
        form=form,
        errors=errors,
        next_query=next_query,
        item_scores=item_scores,
        sorts=SORT_LABELS,
        page_from=bool(_blank(cursor)),
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
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@router.get("/rollouts/{trace_id}")
async def rollout_page(
    request: Request, trace_id: str, db: DatabaseDep, grader: str | None = None
) -> Response:
    if not await has_session(request):
        return _login_redirect(request)
    try:
        async with db.session() as session:
            service = ReviewService(session)
            timeline = await service.timeline(trace_id)
            graded_on = await service.graded_on(trace_id, _blank(grader))
    except NotFound as exc:
        return render(request, "not_found.html", status_code=404, message=exc.message)
    batches: list[list[Any]] = []
    for call in timeline.calls:
        if not batches or batches[-1][0].batch != call.batch:
            batches.append([])
        batches[-1].append(call)
    return render(
        request,
        "rollout.html",
        timeline=timeline,
        batches=batches,
        graded_on=graded_on,
        item_fields=_item_fields(graded_on.item or {}),
    )


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
        if _is_messages(value):
            fields.append(ItemField(name, "messages", value))
        elif name == "tools" and isinstance(value, list):
            fields.append(ItemField(name, "tools", value))
        elif isinstance(value, str):
            fields.append(ItemField(name, "text", value))
        else:
            fields.append(ItemField(name, "json", _json_text(value)))
    return fields


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _json_text(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2, default=str).decode()


def _content(message: dict[str, Any]) -> str:
    """A chat message's text (content parts joined); tool calls it made as JSON."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    else:
        text = "" if content is None else str(content)
    if message.get("tool_calls"):
        text += ("\n" if text else "") + _json_text(message["tool_calls"])
    return text


def _tool_name(tool: Any) -> str:
    if isinstance(tool, dict):
        function = tool.get("function")
        if isinstance(function, dict) and function.get("name"):
            return str(function["name"])
        if tool.get("name"):
            return str(tool["name"])
    return "?"


def _size(text: str | None) -> str:
    n = len((text or "").encode())
    if n < 1000:
        return f"{n} B"
    return f"{n / 1000:.1f} kB" if n < 1_000_000 else f"{n / 1_000_000:.2f} MB"


@router.post("/rollouts/{trace_id}/recompute-flags")
async def recompute_page(request: Request, trace_id: str, db: DatabaseDep) -> Response:
    if not await has_session(request):
        return _login_redirect(request)
    async with db.session(write=True) as session:
        await ReviewService(session).recompute_flags(trace_id)
    return RedirectResponse(f"/review/rollouts/{quote(trace_id)}", status_code=303)


@router.get("/runs")
async def runs_page(request: Request, db: DatabaseDep) -> Response:
    if not await has_session(request):
        return _login_redirect(request)
    async with db.session() as session:
        runs = await ReviewService(session).runs()
    return render(request, "runs.html", runs=runs)


def _run_charts(stats: RunStats, items: list[charts.ItemPoint]) -> dict[str, Any]:
    reward = stats.reward.histogram
    cpr = stats.calls_per_rollout_histogram
    width_one = all(b - a == 1 for a, b in zip(cpr.edges, cpr.edges[1:], strict=False))
    lo, hi = reward.edges[0], reward.edges[-1]
    return {
        "reward": charts.bar_chart(
            "reward",
            "Reward histogram (latest grade per rollout)",
            [f"{a:.2g}–{b:.2g}" for a, b in zip(reward.edges, reward.edges[1:], strict=False)],
            reward.counts,
            x_label="score",
            y_label="rollouts",
        ),
        "calls": charts.bar_chart(
            "calls-per-rollout",
            "Tool calls per rollout",
            [
                f"{a:g}" if width_one else f"{a:g}–{b - 1:g}"
                for a, b in zip(cpr.edges, cpr.edges[1:], strict=False)
            ],
            cpr.counts,
            x_label="tool calls",
            y_label="rollouts",
        ),
        "latency": charts.latency_chart(
            "tool-latency",
            "Latency per tool (p50, p90, p99)",
            [
                charts.ToolLatency(
                    t.tool, t.latency_p50_ms or 0.0, t.latency_p90_ms or 0.0, t.latency_p99_ms or 0.0
                )
                for t in stats.tools
            ],
        ),
        "item_variance": charts.item_chart(
            "item-variance", "Per-item mean score and spread", items, lo=min(0.0, lo), hi=max(1.0, hi)
        ),
    }


def _curve_charts(curve: RewardCurve) -> dict[str, Any]:
    """The learning curve: one point per window of reward (with its ±1 std band), calls, errors, flags."""
    windows = curve.windows
    if not windows:
        return {}
    count = (windows[-1].index + 1) if curve.axis == "order" else CURVE_WINDOWS

    def x(w: CurveWindow) -> float:
        return (w.index + 0.5) / count

    if curve.axis == "time":
        step = windows[0].end - windows[0].start
        first = windows[0].start - windows[0].index * step
        seconds = (step * count).total_seconds()

        def stamp(moment: datetime) -> str:
            moment = moment.astimezone(UTC)
            if seconds > 86400:
                return moment.strftime("%m-%d %H:%M")
            if seconds < 10:
                return moment.strftime("%H:%M:%S.%f")[:-3]
            return moment.strftime("%H:%M:%S")

        ticks = [(i / 4, stamp(first + step * (count * i / 4))) for i in range(5)]
        x_label = "time (UTC) of the rollouts' first calls"
    else:
        total = sum(w.rollouts for w in windows)
        ticks = [(0.0, "1"), (0.5, f"{total // 2:,}"), (1.0, f"{total:,}")]
        x_label = "rollouts in the order they started"

    def where(w: CurveWindow) -> str:
        if curve.axis == "time":
            return f"{_when(w.start)} – {_when(w.end)}"
        return f"window {w.index + 1}"

    reward = [
        charts.CurvePoint(
            x(w),
            w.reward_mean,
            w.reward_mean - (w.reward_std or 0.0),
            w.reward_mean + (w.reward_std or 0.0),
            f"{where(w)}: mean {_score(w.reward_mean)} ± {_score(w.reward_std)}, {w.scored} scored",
        )
        for w in windows
        if w.reward_mean is not None
    ]
    means = [p.y for p in reward]
    calls = [
        charts.CurvePoint(
            x(w), w.calls_per_rollout, None, None, f"{where(w)}: {w.calls_per_rollout:.3g} calls"
        )
        for w in windows
    ]
    errors = [
        charts.CurvePoint(
            x(w),
            w.tool_errors_per_rollout,
            None,
            None,
            f"{where(w)}: {w.tool_errors} tool errors in {w.rollouts} rollouts",
        )
        for w in windows
    ]
    names = curve.flag_names[:CURVE_FLAGS]
    series = [(n, [w.flags.get(n, 0) / w.rollouts for w in windows]) for n in names]
    return {
        "reward": charts.curve_chart(
            "reward-curve",
            "Reward per window: mean and ±1 std band",
            reward,
            x_label=x_label,
            y_label="reward",
            x_ticks=ticks,
            lo=min([0.0, *means]),
            hi=max([1.0, *means]),
        ),
        "calls": charts.curve_chart(
            "calls-curve",
            "Tool calls per rollout, per window",
            calls,
            x_label=x_label,
            y_label="calls per rollout",
            x_ticks=ticks,
            lo=0.0,
        ),
        "errors": charts.curve_chart(
            "errors-curve",
            "Tool errors per rollout, per window",
            errors,
            x_label=x_label,
            y_label="errors per rollout",
            x_ticks=ticks,
            lo=0.0,
        ),
        "flags": charts.lines_chart(
            "flags-curve",
            "Share of rollouts flagged, per window",
            [x(w) for w in windows],
            series,
            x_label=x_label,
            y_label="share of rollouts",
            x_ticks=ticks,
        )
        if series
        else None,
    }


@router.get("/run")
async def run_page(
    request: Request,
    db: DatabaseDep,
    name: Annotated[str, Query()],
    grader: str | None = None,
    axis: str | None = None,
) -> Response:
    if not await has_session(request):
        return _login_redirect(request)
    chosen = _blank(grader)
    curve_axis = "order" if axis == "order" else "time"
    async with db.session() as session:
        service = ReviewService(session, sessions=db.sessions)
        stats = await service.run_stats(name, chosen)
        items = await service.item_stats(name, chosen, order="mean", limit=ITEMS_IN_CHART)
        graders = await service.graders(name)
        curve = await service.reward_curve(name, chosen, axis=curve_axis, windows=CURVE_WINDOWS)
    points = [charts.ItemPoint(i.item_key or "(none)", i.mean, i.std, i.rollouts) for i in items.items]
    return render(
        request,
        "run.html",
        stats=stats,
        items=items,
        graders=graders,
        grader=chosen or "",
        curve=curve,
        curve_charts=_curve_charts(curve),
        charts=_run_charts(stats, points),
        items_capped=items.next_offset is not None,
        export_url=f"/export?{urlencode({'run': name})}",
    )


def _compare_charts(c: RunComparison) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ha, hb = c.reward_histogram_a, c.reward_histogram_b
    if ha is not None and hb is not None:
        # Shares of each run's scored rollouts, on one scale: runs of different sizes compare.
        shares = {
            side: [100 * n / (sum(h.counts) or 1) for n in h.counts] for side, h in (("a", ha), ("b", hb))
        }
        top = max([*shares["a"], *shares["b"]], default=0) or 1
        labels = [f"{x:.2g}–{y:.2g}" for x, y in zip(ha.edges, ha.edges[1:], strict=False)]
        for side, run in (("a", c.a.run), ("b", c.b.run)):
            out[f"reward_{side}"] = charts.bar_chart(
                f"reward-{side}",
                f"Reward histogram of {run} (% of its scored rollouts)",
                labels,
                shares[side],
                x_label="score",
                y_label="% of scored rollouts",
                top=top,
            )
    if c.item_deltas:
        points = [charts.PairPoint(d.item_key or "(none)", d.mean_a, d.mean_b) for d in c.item_deltas]
        values = [v for p in points for v in (p.a, p.b)]
        out["items"] = charts.pair_chart(
            "item-pairs",
            "Per-item mean score, baseline against compared",
            points,
            a_label=f"mean in {c.a.run}",
            b_label=f"mean in {c.b.run}",
            lo=min([0.0, *values]),
            hi=max([1.0, *values]),
        )
    return out


def _signed(value: float | None, digits: str = ".3g", unit: str = "") -> str:
    """A change with its sign always shown (−, not -); '0' when nothing changed; '' when unknown."""
    if value is None:
        return ""
    if abs(value) < 1e-12:
        return f"0{unit}"
    text = format(abs(value), digits)
    return f"{'+' if value > 0 else '−'}{text}{unit}"


def _signed_pct(value: float | None) -> str:
    return "" if value is None else _signed(100 * value, ".1f", " pp")


@router.get("/compare")
async def compare_page(
    request: Request,
    db: DatabaseDep,
    a: str | None = None,
    b: str | None = None,
    grader: str | None = None,
) -> Response:
    if not await has_session(request):
        return _login_redirect(request)
    chosen = _blank(grader)
    async with db.session() as session:
        service = ReviewService(session, sessions=db.sessions)
        runs = await service.runs()
        graders = await service.graders()
        comparison = await service.compare(a, b, chosen) if a and b and _blank(a) and _blank(b) else None
    return render(
        request,
        "compare.html",
        compare_charts=_compare_charts(comparison) if comparison else None,
        runs=runs,
        graders=graders,
        grader=chosen or "",
        comparison=comparison,
        a=a or "",
        b=b or "",
    )


@router.get("/flags")
async def flags_page(
    request: Request,
    db: DatabaseDep,
    run: str | None = None,
    flag: str | None = None,
    grader: str | None = None,
) -> Response:
    if not await has_session(request):
        return _login_redirect(request)
    chosen = _blank(grader)
    async with db.session() as session:
        service = ReviewService(session)
        counts = await service.flag_counts(_blank(run), chosen)
        runs = await service.runs()
        graders = await service.graders(_blank(run))
        flagged = None
        if _blank(flag):
            flagged = await service.rollouts(
                RolloutFilter(run=_blank(run), flag=_blank(flag), grader=chosen),
                limit=PAGE_SIZE,
                cursor=None,
                count=True,
            )
    return render(
        request,
        "flags.html",
        counts=counts,
        runs=runs,
        graders=graders,
        grader=chosen or "",
        run=run or "",
        flag=flag or "",
        flagged=flagged,
    )
