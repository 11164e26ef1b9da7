"""Shapes of the review API's lists and statistics (a rollout's own shapes are in app/rollouts/shapes.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from app.rollouts.shapes import GradeOut, RolloutSummary


class RolloutPage(BaseModel):
    rollouts: list[RolloutSummary]
    next_cursor: str | None
    total: int | None = None  # rollouts matching the filters (asked with count=true)


class GraderOut(BaseModel):
    grader: str
    rollouts: int  # rollouts with at least one grade of this grader


class RunOut(BaseModel):
    run: str | None
    rollouts: int
    channels: dict[str, int]  # rollouts per channel (rft, mcp)
    first_seen: datetime
    last_seen: datetime


class RunSummary(RunOut):
    """A run on the runs page: its rollouts, reward (latest grade of each rollout), grader, model."""

    scored: int = 0
    reward_mean: float | None = None
    grader: str | None = None  # the grader of most of the run's latest grades
    graders: list[str] = []
    models: list[str] = []  # named by the run's stored conversations, most rollouts first
    reward_windows: list[float | None] = []  # reward mean per window of rollouts in start order
    canary: str | None = None  # the canary policy, for a run of `sparring canary`


class RunGroup(BaseModel):
    """Runs shown together: one run, or the runs of one `sparring canary` (`<label>-<policy>`)."""

    label: str | None
    canary: bool
    runs: list[RunSummary]


class Histogram(BaseModel):
    edges: list[float]  # len(counts) + 1 bin edges; the last bin includes its top edge
    counts: list[int]


class CountDistribution(BaseModel):
    """How many rollouts made each number of calls."""

    values: list[int]
    counts: list[int]
    mean: float | None
    p50: int | None
    p90: int | None
    max: int | None


class RewardStats(BaseModel):
    graded: int
    failed: int
    scored: int
    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    histogram: Histogram


class ToolStats(BaseModel):
    tool: str
    calls: int
    share: float  # of the run's calls
    latency_mean_ms: float
    latency_p50_ms: float | None
    latency_p90_ms: float | None
    latency_p99_ms: float | None
    latency_max_ms: float
    output_bytes_mean: float
    outcomes: dict[str, int]
    errors: int  # tool_crash + infra_error: calls the environment failed


class LatencyStats(BaseModel):
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None


class PlatformMetrics(BaseModel):
    """The four tool metrics the hosted fine-tuning platforms chart."""

    tool_calls_per_rollout: float | None
    output_bytes_per_call: float | None  # proxy for tokens per tool call (about 4 bytes per token)
    tool_latency: LatencyStats
    tool_errors: int
    model_errors: int  # `Error: ...` answers the model caused (status 200)


class ItemSummaryOut(BaseModel):
    items: int
    repeated_items: int  # items with at least `min_rollouts` scored rollouts
    always_zero: int
    always_one: int
    share_always_zero: float | None  # of the repeated items
    share_always_one: float | None
    share_no_signal: float | None  # always 0 or always 1: nothing to learn from


class FlagCount(BaseModel):
    name: str
    rollouts: int


class RunStats(BaseModel):
    run: str
    grader: str | None
    rollouts: int
    reward: RewardStats
    calls_per_rollout: CountDistribution
    calls_per_rollout_histogram: Histogram
    tools: list[ToolStats]
    errors_by_outcome: dict[str, int]
    platform: PlatformMetrics
    items: ItemSummaryOut
    flags: list[FlagCount]


class ItemStats(BaseModel):
    item_key: str | None
    rollouts: int
    mean: float
    variance: float  # population variance of the item's scores
    std: float
    min: float
    max: float
    always_zero: bool
    always_one: bool


class ItemStatsPage(BaseModel):
    run: str
    grader: str | None
    summary: ItemSummaryOut
    items: list[ItemStats]
    next_offset: int | None


class RunSide(BaseModel):
    run: str
    rollouts: int
    reward_mean: float | None
    reward_std: float | None
    graded: int
    calls_per_rollout: float | None
    latency: LatencyStats
    output_bytes_per_call: float | None
    tool_errors: int
    model_errors: int  # calls answered `Error: ...` (bad arguments, refusals): where drift shows first
    model_error_share: float | None  # of the run's calls
    channels: dict[str, int]  # rollouts per channel: a training run is rft, a production run mcp
    share_no_signal: float | None
    reward_min: float | None = None
    reward_max: float | None = None
    reward_se: float | None = None  # standard error of reward_mean (None under 2 graded rollouts)


class ToolMix(BaseModel):
    tool: str
    calls_a: int
    calls_b: int
    share_a: float
    share_b: float
    share_delta: float = 0.0  # share_b - share_a


class ItemDelta(BaseModel):
    item_key: str | None
    rollouts_a: int
    rollouts_b: int
    mean_a: float
    mean_b: float
    delta: float  # mean_b - mean_a


class ItemChanges(BaseModel):
    common: int
    improved: int
    regressed: int
    unchanged: int
    mean_delta: float | None


class RunComparison(BaseModel):
    a: RunSide
    b: RunSide
    reward_delta: float | None
    reward_delta_se: float | None = None  # sqrt(se_a² + se_b²)
    # 95% interval of reward_delta, by a bootstrap over items (app/review/uncertainty.py); None under
    # 2 scored items in a run.
    reward_delta_ci: tuple[float, float] | None = None
    bootstrap_resamples: int = 0
    calls_per_rollout_delta: float | None
    latency_p50_delta_ms: float | None
    tool_mix: list[ToolMix]
    items: ItemChanges
    # Both runs' latest scores binned on the same edges (side by side histograms).
    reward_histogram_a: Histogram | None = None
    reward_histogram_b: Histogram | None = None
    # Items in both runs, most improved first (at most MAX_ITEM_DELTAS; item_deltas_capped says so).
    item_deltas: list[ItemDelta] = []
    item_deltas_capped: bool = False


class RecomputedFlags(BaseModel):
    trace_id: str
    grades: list[GradeOut]


class GradedOn(BaseModel):
    """What a rollout's grade was given: the dataset row and the sample, and how the item fares."""

    trace_id: str
    grade_id: int | None  # the grade read (the latest, of `grader` if given); None: not graded
    grader: str | None
    run: str | None
    item_key: str | None
    item: dict[str, Any] | None  # the dataset row as the grader received it
    sample: dict[str, Any] | None
    answer: str  # the sample's final text
    output_tools: list[Any]  # tool calls the final answer listed (sample.output_tools or the last message's)
    item_scores: ItemStats | None  # the item's rollouts in this run (latest grade, of `grader` if given)


class CurveWindow(BaseModel):
    """One window of a run's learning curve (rollouts placed by their first call)."""

    index: int  # 0-based; time windows without rollouts are left out
    start: datetime  # time axis: the window's bounds; order axis: first_seen of its first and last rollout
    end: datetime
    rollouts: int
    scored: int
    reward_mean: float | None  # latest grade per rollout (of `grader`, if given)
    reward_std: float | None  # population std of those scores: the band around the mean
    calls_per_rollout: float
    tool_errors: int  # calls that crashed or met an outage
    tool_errors_per_rollout: float
    flags: dict[str, int]  # rollouts whose latest grade raised each flag


class RewardCurve(BaseModel):
    run: str
    grader: str | None
    axis: str  # time | order
    windows: list[CurveWindow]
    flag_names: list[str]  # every flag raised in the run, most frequent first


class LabelIn(BaseModel):
    """A person's judgment of a rollout."""

    label: Literal["pass", "fail"]
    note: Annotated[str | None, Field(max_length=4000)] = None


class LabelOut(BaseModel):
    trace_id: str
    label: str  # pass | fail
    note: str | None
    labelled_by: str  # session (a signed-in reviewer) or admin (an admin key)
    labelled_at: datetime


class QueueEntry(BaseModel):
    trace_id: str
    item_key: str | None
    score: float | None  # of the rollout's latest grade (of the grader asked for)
    band: str  # the score band it was drawn from ("ungraded" without a score)


class LabelQueue(BaseModel):
    """The next rollouts to label in a run, stratified over score bands and items."""

    run: str
    grader: str | None
    unlabelled: int
    labelled: int
    rollouts: list[QueueEntry]


class PairAgreement(BaseModel):
    """Two graders on the rollouts both scored (None: undefined on these scores)."""

    a: str
    b: str
    n: int
    agreement: float | None
    kappa: float | None
    spearman: float | None
    disagreed: int  # rollouts where one passes and the other does not
    disagreements: list[str]  # their trace ids (the first MAX_DISAGREEMENTS of them)


class LabelAgreement(BaseModel):
    """A grader against people's labels on the rollouts both judged ("pass" is the positive class)."""

    grader: str
    n: int
    agreement: float | None
    kappa: float | None
    precision: float | None
    recall: float | None
    disagreed: int  # rollouts where the grader and the label differ
    disagreements: list[str]  # their trace ids (the first MAX_DISAGREEMENTS of them)


class Agreement(BaseModel):
    run: str
    threshold: float
    pairs: list[PairAgreement]
    labels: list[LabelAgreement]


class AuditSignal(BaseModel):
    """One signal of a run's audit: the first window against the last, and the rollouts to open."""

    name: str
    fired: bool
    summary: str
    first: float | None  # the signal's value in the first window (None: not measured there)
    last: float | None
    evidence: list[str]  # trace ids to open (when it fired)
    about: str  # what the signal can and cannot tell


class Audit(BaseModel):
    run: str
    grader: str | None  # the reward: the latest grade of this grader (None: of any grader)
    rollouts: int  # graded rollouts read
    windows: int
    signals: list[AuditSignal]
    fired: list[str]
    note: str | None  # why no signal was measured
