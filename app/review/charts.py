"""Charts drawn as inline SVG on the server: no scripts, no CDN, every label escaped."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from markupsafe import Markup, escape

from app.review.formatting import score, when
from app.review.schemas import CurveWindow, RewardCurve, RunComparison, RunStats

WIDTH, HEIGHT = 640, 240
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 48, 12, 12, 44


def _num(value: float) -> str:
    return f"{value:.1f}"


def _label(value: float) -> str:
    return f"{value:.3g}"


def _frame(chart: str, title: str, body: list[str], width: int = WIDTH, height: int = HEIGHT) -> Markup:
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="{escape(chart)}" '
        f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{escape(title)}"><title>{escape(title)}</title>'
    )
    return Markup(head + "".join(body) + "</svg>")


def _axes(plot_w: float, plot_h: float, top: float, x_label: str, y_label: str) -> list[str]:
    x0, y0 = MARGIN_LEFT, MARGIN_TOP + plot_h
    return [
        f'<line class="axis" x1="{x0}" y1="{MARGIN_TOP}" x2="{x0}" y2="{_num(y0)}" stroke="#555"/>',
        f'<line class="axis" x1="{x0}" y1="{_num(y0)}" x2="{_num(x0 + plot_w)}" y2="{_num(y0)}" '
        'stroke="#555"/>',
        f'<text class="tick" x="{x0 - 4}" y="{MARGIN_TOP + 8}" text-anchor="end">'
        f"{escape(_label(top))}</text>",
        f'<text class="tick" x="{x0 - 4}" y="{_num(y0)}" text-anchor="end">0</text>',
        f'<text class="axis-label" x="{_num(x0 + plot_w / 2)}" y="{_num(y0 + 36)}" '
        f'text-anchor="middle">{escape(x_label)}</text>',
        f'<text class="axis-label" x="12" y="{_num(MARGIN_TOP + plot_h / 2)}" text-anchor="middle" '
        f'transform="rotate(-90 12 {_num(MARGIN_TOP + plot_h / 2)})">{escape(y_label)}</text>',
    ]


def bar_chart(
    chart: str,
    title: str,
    labels: Sequence[str],
    values: Sequence[float],
    *,
    x_label: str,
    y_label: str,
    top: float | None = None,
) -> Markup:
    """One bar per value (zero-height bars included, so the bar count is the bin count).

    `top` fixes the height scale (to draw two histograms on the same scale)."""
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    top = top or max(values, default=0) or 1
    step = plot_w / max(1, len(values))
    body = _axes(plot_w, plot_h, top, x_label, y_label)
    every = max(1, len(labels) // 10)
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        h = plot_h * value / top
        x = MARGIN_LEFT + i * step
        body.append(
            f'<rect class="bar" x="{_num(x + 1)}" y="{_num(MARGIN_TOP + plot_h - h)}" '
            f'width="{_num(max(1.0, step - 2))}" height="{_num(h)}" fill="#3b6ea5">'
            f"<title>{escape(label)}: {escape(_label(value))}</title></rect>"
        )
        if i % every == 0:
            body.append(
                f'<text class="tick" x="{_num(x + step / 2)}" y="{_num(MARGIN_TOP + plot_h + 14)}" '
                f'text-anchor="middle">{escape(label)}</text>'
            )
    return _frame(chart, title, body)


@dataclass(frozen=True)
class ToolLatency:
    tool: str
    p50: float
    p90: float
    p99: float


def latency_chart(chart: str, title: str, tools: Sequence[ToolLatency]) -> Markup:
    """Per tool, three horizontal bars: p50, p90, p99 latency (ms)."""
    row_h, label_w = 42, 140
    height = MARGIN_TOP + MARGIN_BOTTOM + row_h * max(1, len(tools))
    plot_w = WIDTH - label_w - MARGIN_RIGHT - 60
    top = max((t.p99 for t in tools), default=0) or 1
    body = [
        f'<text class="axis-label" x="{label_w + plot_w / 2:.1f}" y="{height - 8}" '
        f'text-anchor="middle">latency (ms), max {escape(_label(top))}</text>'
    ]
    colors = {"p50": "#3b6ea5", "p90": "#e09b3d", "p99": "#c44e52"}
    for i, tool in enumerate(tools):
        y = MARGIN_TOP + i * row_h
        body.append(
            f'<text class="tick" x="{label_w - 6}" y="{y + row_h / 2 + 4:.1f}" text-anchor="end">'
            f"{escape(tool.tool[:24])}</text>"
        )
        for j, (name, value) in enumerate((("p50", tool.p50), ("p90", tool.p90), ("p99", tool.p99))):
            w = max(1.0, plot_w * value / top)
            body.append(
                f'<rect class="bar {name}" x="{label_w}" y="{y + 4 + j * 11}" width="{_num(w)}" height="10" '
                f'fill="{colors[name]}"><title>{escape(tool.tool)} {name}: {escape(_label(value))} ms</title>'
                f"</rect>"
            )
            body.append(
                f'<text class="value" x="{_num(label_w + w + 4)}" y="{y + 13 + j * 11}">'
                f"{name} {escape(_label(value))}</text>"
            )
    return _frame(chart, title, body, height=height)


@dataclass(frozen=True)
class ItemPoint:
    item_key: str
    mean: float
    std: float
    rollouts: int


def item_chart(
    chart: str, title: str, items: Sequence[ItemPoint], *, lo: float = 0.0, hi: float = 1.0
) -> Markup:
    """The variance plot: one bar per item (its mean score, items sorted by mean) with a ±1 std whisker."""
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    span = (hi - lo) or 1.0
    step = plot_w / max(1, len(items))
    body = _axes(plot_w, plot_h, hi, f"items ({len(items)}, sorted by mean score)", "mean score")

    def y_of(value: float) -> float:
        return MARGIN_TOP + plot_h - plot_h * (min(hi, max(lo, value)) - lo) / span

    for i, item in enumerate(items):
        x = MARGIN_LEFT + i * step
        y = y_of(item.mean)
        cls, fill = "bar", "#3b6ea5"
        if item.rollouts > 1 and item.std == 0 and item.mean <= lo:
            cls, fill, y = "bar always-zero", "#c44e52", y - 3  # a sliver at the axis, so it stays visible
        elif item.rollouts > 1 and item.std == 0 and item.mean >= hi:
            cls, fill = "bar always-one", "#4c9a6a"
        body.append(
            f'<rect class="{cls}" x="{_num(x + 0.5)}" y="{_num(y)}" width="{_num(max(0.5, step - 1))}" '
            f'height="{_num(MARGIN_TOP + plot_h - y)}" fill="{fill}">'
            f"<title>{escape(item.item_key)}: mean {escape(_label(item.mean))}, std "
            f"{escape(_label(item.std))}, {item.rollouts} rollouts</title></rect>"
        )
        if item.std > 0:
            cx = x + step / 2
            body.append(
                f'<line class="whisker" x1="{_num(cx)}" x2="{_num(cx)}" '
                f'y1="{_num(y_of(item.mean + item.std))}" '
                f'y2="{_num(y_of(item.mean - item.std))}" stroke="#222"/>'
            )
    return _frame(chart, title, body)


@dataclass(frozen=True)
class CurvePoint:
    x: float  # position along the axis, 0..1
    y: float
    low: float | None  # the band around y (e.g. mean - std); None: no band at this point
    high: float | None
    label: str  # shown on hover


PALETTE = ("#c44e52", "#3b6ea5", "#e09b3d", "#4c9a6a", "#8172b3", "#937860", "#da8bc3", "#555555")


def _plot_axes(plot_w: float, plot_h: float, x_label: str, y_label: str) -> list[str]:
    """The two axis lines and their labels (ticks are the caller's)."""
    x0, y0, mid = MARGIN_LEFT, MARGIN_TOP + plot_h, MARGIN_TOP + plot_h / 2
    return [
        f'<line class="axis" x1="{x0}" y1="{MARGIN_TOP}" x2="{x0}" y2="{_num(y0)}" stroke="#555"/>',
        f'<line class="axis" x1="{x0}" y1="{_num(y0)}" x2="{_num(x0 + plot_w)}" y2="{_num(y0)}" '
        'stroke="#555"/>',
        f'<text class="axis-label" x="{_num(x0 + plot_w / 2)}" y="{_num(y0 + 36)}" '
        f'text-anchor="middle">{escape(x_label)}</text>',
        f'<text class="axis-label" x="12" y="{_num(mid)}" text-anchor="middle" '
        f'transform="rotate(-90 12 {_num(mid)})">{escape(y_label)}</text>',
    ]


def _y_axis(lo: float, hi: float, plot_h: float) -> list[str]:
    """Ticks at lo, the middle and hi on the left axis."""
    out = []
    for value in (lo, (lo + hi) / 2, hi):
        y = MARGIN_TOP + plot_h - plot_h * (value - lo) / ((hi - lo) or 1.0)
        out.append(
            f'<text class="tick" x="{MARGIN_LEFT - 4}" y="{_num(y + 3)}" text-anchor="end">'
            f"{escape(_label(value))}</text>"
        )
        out.append(
            f'<line class="grid" x1="{MARGIN_LEFT}" x2="{WIDTH - MARGIN_RIGHT}" '
            f'y1="{_num(y)}" y2="{_num(y)}" stroke="#e5e7eb"/>'
        )
    return out


def _x_ticks(ticks: Sequence[tuple[float, str]], plot_w: float, plot_h: float) -> list[str]:
    """Labels along the x axis; the ends are anchored inwards so that they are not cut off."""

    def anchor(x: float) -> str:
        return "start" if x <= 0.0 else "end" if x >= 1.0 else "middle"

    return [
        f'<text class="tick" x="{_num(MARGIN_LEFT + plot_w * x)}" y="{_num(MARGIN_TOP + plot_h + 14)}" '
        f'text-anchor="{anchor(x)}">{escape(text)}</text>'
        for x, text in ticks
    ]


def curve_chart(
    chart: str,
    title: str,
    points: Sequence[CurvePoint],
    *,
    x_label: str,
    y_label: str,
    x_ticks: Sequence[tuple[float, str]] = (),
    lo: float | None = None,
    hi: float | None = None,
) -> Markup:
    """A line through one point per window, over a band (the spread of each window)."""
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    values = [p.y for p in points] + [v for p in points for v in (p.low, p.high) if v is not None]
    bottom = lo if lo is not None else min(values, default=0.0)
    top = hi if hi is not None else max(values, default=1.0)
    if top <= bottom:
        top = bottom + 1.0
    span = top - bottom

    def px(x: float) -> float:
        return MARGIN_LEFT + plot_w * min(1.0, max(0.0, x))

    def py(y: float) -> float:
        return MARGIN_TOP + plot_h - plot_h * (min(top, max(bottom, y)) - bottom) / span

    body = [
        *_plot_axes(plot_w, plot_h, x_label, y_label),
        *_y_axis(bottom, top, plot_h),
        *_x_ticks(x_ticks, plot_w, plot_h),
    ]
    banded = [p for p in points if p.low is not None and p.high is not None]
    if len(banded) > 1:
        upper = " ".join(f"{_num(px(p.x))},{_num(py(p.high or 0.0))}" for p in banded)
        lower = " ".join(f"{_num(px(p.x))},{_num(py(p.low or 0.0))}" for p in reversed(banded))
        body.append(f'<polygon class="band" points="{upper} {lower}" fill="#3b6ea5" fill-opacity="0.18"/>')
    if len(points) > 1:
        line = " ".join(f"{_num(px(p.x))},{_num(py(p.y))}" for p in points)
        body.append(f'<polyline class="line" points="{line}" fill="none" stroke="#3b6ea5" stroke-width="2"/>')
    for p in points:
        body.append(
            f'<circle class="point" cx="{_num(px(p.x))}" cy="{_num(py(p.y))}" r="3.5" fill="#3b6ea5">'
            f"<title>{escape(p.label)}</title></circle>"
        )
    return _frame(chart, title, body)


def lines_chart(
    chart: str,
    title: str,
    xs: Sequence[float],
    series: Sequence[tuple[str, Sequence[float]]],
    *,
    x_label: str,
    y_label: str,
    x_ticks: Sequence[tuple[float, str]] = (),
) -> Markup:
    """Several lines over the same windows (one per series, with a legend), from 0 up."""
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT - 150
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    top = max((v for _, values in series for v in values), default=0.0) or 1.0

    def px(x: float) -> float:
        return MARGIN_LEFT + plot_w * min(1.0, max(0.0, x))

    def py(y: float) -> float:
        return MARGIN_TOP + plot_h - plot_h * y / top

    body = [
        *_plot_axes(plot_w, plot_h, x_label, y_label),
        f'<text class="tick" x="{MARGIN_LEFT - 4}" y="{MARGIN_TOP + 8}" text-anchor="end">'
        f"{escape(_label(top))}</text>",
        f'<text class="tick" x="{MARGIN_LEFT - 4}" y="{_num(MARGIN_TOP + plot_h)}" '
        'text-anchor="end">0</text>',
        *_x_ticks(x_ticks, plot_w, plot_h),
    ]
    for i, (name, values) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        coords = [(px(x), py(v)) for x, v in zip(xs, values, strict=True)]
        if len(coords) > 1:
            body.append(
                f'<polyline class="series" data-series="{escape(name)}" points="'
                + " ".join(f"{_num(x)},{_num(y)}" for x, y in coords)
                + f'" fill="none" stroke="{color}" stroke-width="1.8"/>'
            )
        for (x, y), v in zip(coords, values, strict=True):
            body.append(
                f'<circle class="series-point" cx="{_num(x)}" cy="{_num(y)}" r="2.5" fill="{color}">'
                f"<title>{escape(name)}: {escape(_label(v))}</title></circle>"
            )
        ly = MARGIN_TOP + 10 + i * 16
        lx = MARGIN_LEFT + plot_w + 12
        body.append(f'<rect x="{_num(lx)}" y="{ly - 8}" width="10" height="10" fill="{color}"/>')
        body.append(f'<text class="legend" x="{_num(lx + 14)}" y="{ly + 1}">{escape(name[:24])}</text>')
    return _frame(chart, title, body)


@dataclass(frozen=True)
class PairPoint:
    label: str
    a: float
    b: float


PAIR_KINDS = {"improved": "improved", "regressed": "regressed", "unchanged": "unchanged"}


def pair_chart(
    chart: str,
    title: str,
    points: Sequence[PairPoint],
    *,
    a_label: str,
    b_label: str,
    lo: float,
    hi: float,
    legend: dict[str, str] = PAIR_KINDS,
) -> Markup:
    """One dot per point: a (x) against b (y), over the diagonal where they are equal; `legend` names the
    dots above it (improved), below it (regressed) and on it (unchanged)."""
    size = 320
    width = MARGIN_LEFT + size + 160
    span = (hi - lo) or 1.0

    def px(v: float) -> float:
        return MARGIN_LEFT + size * (min(hi, max(lo, v)) - lo) / span

    def py(v: float) -> float:
        return MARGIN_TOP + size - size * (min(hi, max(lo, v)) - lo) / span

    body = [
        *_plot_axes(size, size, a_label, b_label),
        f'<line class="diagonal" x1="{_num(px(lo))}" y1="{_num(py(lo))}" x2="{_num(px(hi))}" '
        f'y2="{_num(py(hi))}" stroke="#999" stroke-dasharray="4 3"/>',
        f'<text class="tick" x="{MARGIN_LEFT - 4}" y="{MARGIN_TOP + 8}" text-anchor="end">'
        f"{escape(_label(hi))}</text>",
        f'<text class="tick" x="{MARGIN_LEFT - 4}" y="{_num(MARGIN_TOP + size)}" text-anchor="end">'
        f"{escape(_label(lo))}</text>",
        f'<text class="tick" x="{_num(px(hi))}" y="{_num(MARGIN_TOP + size + 14)}" text-anchor="end">'
        f"{escape(_label(hi))}</text>",
    ]
    colors = {"improved": "#4c9a6a", "regressed": "#c44e52", "unchanged": "#888888"}
    # Items on the same spot (means of few rollouts often coincide) are one dot, sized and counted.
    spots: dict[tuple[float, float], list[PairPoint]] = {}
    for p in points:
        spots.setdefault((round(px(p.a)), round(py(p.b))), []).append(p)
    for group in spots.values():
        p, count = group[0], len(group)
        kind = "improved" if p.b - p.a > 1e-9 else "regressed" if p.a - p.b > 1e-9 else "unchanged"
        names = ", ".join(q.label for q in group[:5]) + (f" and {count - 5} more" if count > 5 else "")
        radius = 3.5 + 1.5 * math.sqrt(count - 1)
        body.append(
            f'<circle class="pair {kind}" data-items="{count}" cx="{_num(px(p.a))}" cy="{_num(py(p.b))}" '
            f'r="{_num(radius)}" fill="{colors[kind]}" fill-opacity="0.75"><title>{escape(names)}: '
            f"{escape(_label(p.a))} → {escape(_label(p.b))}</title></circle>"
        )
        if count > 1:
            body.append(
                f'<text class="pair-count" x="{_num(px(p.a) + radius + 2)}" y="{_num(py(p.b) - radius)}">'
                f"{count}</text>"
            )
    for i, (kind, color) in enumerate(colors.items()):
        y = MARGIN_TOP + 10 + i * 16
        x = MARGIN_LEFT + size + 16
        body.append(f'<circle cx="{_num(x)}" cy="{y - 3}" r="4" fill="{color}"/>')
        body.append(f'<text class="legend" x="{_num(x + 10)}" y="{y + 1}">{escape(legend[kind])}</text>')
    return _frame(chart, title, body, width=width, height=MARGIN_TOP + size + MARGIN_BOTTOM)


# --- the charts of the review pages, from the statistics ---------------------------------------------


def run_charts(stats: RunStats, items: list[ItemPoint]) -> dict[str, Any]:
    reward = stats.reward.histogram
    cpr = stats.calls_per_rollout_histogram
    width_one = all(b - a == 1 for a, b in zip(cpr.edges, cpr.edges[1:], strict=False))
    lo, hi = reward.edges[0], reward.edges[-1]
    return {
        "reward": bar_chart(
            "reward",
            "Reward histogram (latest grade per rollout)",
            [f"{a:.2g}–{b:.2g}" for a, b in zip(reward.edges, reward.edges[1:], strict=False)],
            reward.counts,
            x_label="score",
            y_label="rollouts",
        ),
        "calls": bar_chart(
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
        "latency": latency_chart(
            "tool-latency",
            "Latency per tool (p50, p90, p99)",
            [
                ToolLatency(t.tool, t.latency_p50_ms or 0.0, t.latency_p90_ms or 0.0, t.latency_p99_ms or 0.0)
                for t in stats.tools
            ],
        ),
        "item_variance": item_chart(
            "item-variance", "Per-item mean score and spread", items, lo=min(0.0, lo), hi=max(1.0, hi)
        ),
    }


def _curve_ticks(curve: RewardCurve, count: int) -> tuple[list[tuple[float, str]], str]:
    """The x axis of a learning curve: its ticks (0..1) and its label."""
    windows = curve.windows
    if curve.axis != "time":
        total = sum(w.rollouts for w in windows)
        return [
            (0.0, "1"),
            (0.5, f"{total // 2:,}"),
            (1.0, f"{total:,}"),
        ], "rollouts in the order they started"
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
    return ticks, "time (UTC) of the rollouts' first calls"


def _curve_points(curve: RewardCurve, count: int) -> dict[str, list[CurvePoint]]:
    """Per series (reward with its ±1 std band, calls, tool errors), one point per window."""

    def x(w: CurveWindow) -> float:
        return (w.index + 0.5) / count

    def where(w: CurveWindow) -> str:
        return f"{when(w.start)} – {when(w.end)}" if curve.axis == "time" else f"window {w.index + 1}"

    def band(w: CurveWindow, mean: float) -> CurvePoint:
        spread = w.reward_std or 0.0
        text = f"{where(w)}: mean {score(mean)} ± {score(w.reward_std)}, {w.scored} scored"
        return CurvePoint(x(w), mean, mean - spread, mean + spread, text)

    windows = curve.windows
    return {
        "reward": [band(w, w.reward_mean) for w in windows if w.reward_mean is not None],
        "calls": [
            CurvePoint(x(w), w.calls_per_rollout, None, None, f"{where(w)}: {w.calls_per_rollout:.3g} calls")
            for w in windows
        ],
        "errors": [
            CurvePoint(
                x(w),
                w.tool_errors_per_rollout,
                None,
                None,
                f"{where(w)}: {w.tool_errors} tool errors in {w.rollouts} rollouts",
            )
            for w in windows
        ],
    }


def curve_charts(curve: RewardCurve, windows: int, most_flags: int) -> dict[str, Any]:
    """The learning curve: one point per window of reward (with its ±1 std band), calls, errors, flags."""
    if not curve.windows:
        return {}
    count = (curve.windows[-1].index + 1) if curve.axis == "order" else windows
    ticks, x_label = _curve_ticks(curve, count)
    points = _curve_points(curve, count)
    means = [p.y for p in points["reward"]]
    names = curve.flag_names[:most_flags]
    series = [(n, [w.flags.get(n, 0) / w.rollouts for w in curve.windows]) for n in names]
    return {
        "reward": curve_chart(
            "reward-curve",
            "Reward per window: mean and ±1 std band",
            points["reward"],
            y_label="reward",
            lo=min([0.0, *means]),
            hi=max([1.0, *means]),
            x_label=x_label,
            x_ticks=ticks,
        ),
        "calls": curve_chart(
            "calls-curve",
            "Tool calls per rollout, per window",
            points["calls"],
            y_label="calls per rollout",
            lo=0.0,
            x_label=x_label,
            x_ticks=ticks,
        ),
        "errors": curve_chart(
            "errors-curve",
            "Tool errors per rollout, per window",
            points["errors"],
            y_label="errors per rollout",
            lo=0.0,
            x_label=x_label,
            x_ticks=ticks,
        ),
        "flags": lines_chart(
            "flags-curve",
            "Share of rollouts flagged, per window",
            [(w.index + 0.5) / count for w in curve.windows],
            series,
            y_label="share of rollouts",
            x_label=x_label,
            x_ticks=ticks,
        )
        if series
        else None,
    }


def compare_charts(c: RunComparison) -> dict[str, Any]:
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
            out[f"reward_{side}"] = bar_chart(
                f"reward-{side}",
                f"Reward histogram of {run} (% of its scored rollouts)",
                labels,
                shares[side],
                x_label="score",
                y_label="% of scored rollouts",
                top=top,
            )
    if c.item_deltas:
        points = [PairPoint(d.item_key or "(none)", d.mean_a, d.mean_b) for d in c.item_deltas]
        values = [v for p in points for v in (p.a, p.b)]
        out["items"] = pair_chart(
            "item-pairs",
            "Per-item mean score, baseline against compared",
            points,
            a_label=f"mean in {c.a.run}",
            b_label=f"mean in {c.b.run}",
            lo=min([0.0, *values]),
            hi=max([1.0, *values]),
        )
    return out


def grader_scatter(a: str, b: str, points: Sequence[PairPoint]) -> Markup:
    """One dot per rollout: grader a's score (x) against grader b's (y)."""
    values = [v for p in points for v in (p.a, p.b)]
    lo, hi = min([0.0, *values]), max([1.0, *values])
    return pair_chart(
        "graders",
        f"{a} against {b}, one dot per rollout",
        points,
        a_label=a,
        b_label=b,
        lo=lo,
        hi=hi,
        legend={"improved": f"{b} higher", "regressed": f"{a} higher", "unchanged": "equal"},
    )


SPARK_W, SPARK_H = 120, 26


def sparkline(chart: str, title: str, values: Sequence[float | None]) -> Markup:
    """A small line of values (None: a gap) on a 0–1 scale (wider when a value falls outside it)."""
    known = [v for v in values if v is not None]
    if not known:
        return Markup("")
    lo, hi = min(0.0, *known), max(1.0, *known)
    step = SPARK_W / max(len(values) - 1, 1)

    def point(index: int, value: float) -> str:
        return f"{_num(index * step)},{_num(SPARK_H - 2 - (value - lo) / (hi - lo) * (SPARK_H - 4))}"

    body = [f'<line x1="0" y1="{SPARK_H - 2}" x2="{SPARK_W}" y2="{SPARK_H - 2}" stroke="#d9dde3"/>']
    segment: list[str] = []
    for index, value in enumerate([*values, None]):
        if value is not None:
            segment.append(point(index, value))
            continue
        if len(segment) > 1:
            body.append(
                f'<polyline points="{" ".join(segment)}" fill="none" stroke="#3b6ea5" stroke-width="1.5"/>'
            )
        elif segment:
            x, y = segment[0].split(",")
            body.append(f'<circle cx="{x}" cy="{y}" r="1.5" fill="#3b6ea5"/>')
        segment = []
    return _frame(chart, title, body, width=SPARK_W, height=SPARK_H)


SCORE_BAR_W, SCORE_BAR_H = 56, 10


def score_band(value: float) -> str:
    """The class of a score's colour: low (< 0.34), mid, high (≥ 0.67)."""
    return "score-low" if value < 0.34 else ("score-high" if value >= 0.67 else "score-mid")


def score_bar(value: float) -> Markup:
    """A score as a small bar (clamped to 0–1), coloured by its band."""
    share = min(max(value, 0.0), 1.0)
    colour = {"score-low": "#c44e52", "score-mid": "#d9a400", "score-high": "#4c9a6a"}[score_band(value)]
    return Markup(
        f'<svg class="score-bar" width="{SCORE_BAR_W}" height="{SCORE_BAR_H}" viewBox="0 0 {SCORE_BAR_W} '
        f'{SCORE_BAR_H}" role="img" aria-label="score {value:.3g}"><rect width="{SCORE_BAR_W}" '
        f'height="{SCORE_BAR_H}" rx="2" fill="#e8ebf0"/><rect class="fill" '
        f'width="{_num(share * SCORE_BAR_W)}" height="{SCORE_BAR_H}" rx="2" fill="{colour}"/></svg>'
    )
