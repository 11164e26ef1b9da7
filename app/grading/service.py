"""Grading a rollout: load what the server recorded, run the grader, raise flags, store the grade."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from app.db.session import Database
from app.db.text import storable
from app.errors import NotFound, ServiceUnavailable, SparringError
from app.grading.graders.model import (
    GradeInput,
    Grader,
    GradeResult,
    GraderUnavailable,
    RolloutRecord,
    RolloutStateLost,
)
from app.grading.recording import store_grade
from app.grading.repository import GradeRepository
from app.grounding import prompt_texts
from app.metrics import Metrics
from app.rollouts.shapes import RolloutDetail
from app.rollouts.store import RolloutStore
from app.rollouts.timeline import read_timeline
from app.sdk import GradingConfigError
from app.telemetry import Tracing

log = logging.getLogger(__name__)


class GradeUnavailable(ServiceUnavailable):
    code = "grader_unavailable"


class GraderMisconfigured(SparringError):
    """The grader cannot use what it was sent (the dataset row, its own settings): a failed grade.

    A 4xx the trainer sees, so the platform drops the rollout instead of training on a made-up 0.
    """

    status_code = 422
    code = "grader_config_error"


class RolloutStateGone(SparringError):
    """The grader reads rollout state the store no longer holds: refused, nothing stored.

    Not a 503: the state will not come back, so a retry cannot help.
    """

    status_code = 409
    code = "rollout_state_gone"


@dataclass(frozen=True)
class Regraded:
    """What `regrade` changed: how many grades, how many scores moved, the means before and after."""

    grader: str
    version: str
    rollouts: int
    changed: int
    failed: int
    skipped: int  # the grader reads state the store no longer holds: not regraded, nothing stored
    mean_before: float | None
    mean_after: float | None


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(eq=False, kw_only=True)
class GradingService:
    graders: Mapping[str, Grader]
    default: str | None
    store: RolloutStore
    database: Database
    metrics: Metrics
    retry_after: int
    # The tools whose calls the state store records (they read or change rollout state).
    state_tools: Collection[str] = ()
    tracing: Tracing | None = None  # None: tracing is off (app/telemetry.py)
    _config_errors_reported: set[tuple[str, str]] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self.state_tools = frozenset(self.state_tools)

    def resolve(self, name: str | None) -> Grader:
        if not self.graders:
            raise NotFound(
                f"no grader {'named ' + repr(name) if name else 'at /grade'}: none is configured on this "
                "server: set SPARRING_GRADERS_FILE to a YAML or JSON file of grader configs (or enable a "
                "pack with a state check, e.g. retail), then restart it",
                available=[],
            )
        key = name or self.default
        if key is None:
            raise NotFound(
                "no default grader: name one in the URL (/grade/{name}) or set SPARRING_DEFAULT_GRADER",
                available=sorted(self.graders),
            )
        grader = self.graders.get(key)
        if grader is None:
            raise NotFound(f"no grader named {key!r}", available=sorted(self.graders))
        return grader

    def _report_config_error(self, grader: str, message: str) -> None:
        """Loudly, once per grader and cause: every grade of a misconfigured run would repeat it."""
        key = (grader, message)
        if key in self._config_errors_reported:
            return
        if len(self._config_errors_reported) < 1000:  # bounded; past that, every further cause logs each time
            self._config_errors_reported.add(key)
        log.error("grader %s configuration error (grades fail with 422 until fixed): %s", grader, message)

    async def _record(self, timeline: RolloutDetail, trace_id: str, *, with_state: bool) -> RolloutRecord:
        # `trace_id` as the calls sent it: the store's key (the timeline's is as stored, NUL as U+FFFD).
        state = await self.store.changes(trace_id) if with_state else {}
        # The log shows calls of tools that read or write state, but the store has nothing: the state
        # expired or died with its process. (A rollout of stateless tools only never had any.)
        lost = (
            with_state
            and not state
            and any(c.tool in self.state_tools for c in timeline.timeline)
            and not await self.store.seen(trace_id)
        )
        return RolloutRecord(
            trace_id=trace_id,
            calls=timeline.timeline,
            first_seen=timeline.first_seen,
            last_seen=timeline.last_seen,
            state=state,
            state_lost=lost,
        )

    async def prepare(
        self, grader: Grader, sample: Mapping[str, Any], item: Mapping[str, Any], trace_id: str | None
    ) -> tuple[RolloutDetail | None, GradeInput]:
        """What the grader is given: the request, and what the server recorded for the trace."""
        timeline: RolloutDetail | None = None
        if trace_id:
            async with self.database.session() as session:
                timeline = await read_timeline(session, storable(trace_id))
        record = None
        if timeline is not None and trace_id:
            record = await self._record(timeline, trace_id, with_state=grader.needs_rollout)
        return timeline, GradeInput(sample=sample, item=item, trace_id=trace_id, rollout=record)

    async def grade(
        self,
        name: str | None,
        sample: Mapping[str, Any],
        item: Mapping[str, Any],
        trace_id: str | None,
        *,
        run: str | None = None,
    ) -> GradeResult:
        """Grade and store; a 503 (ServiceUnavailable) when the grader or the database is down."""
        grader = self.resolve(name)
        if self.tracing is None:
            return (await self._grade(grader, sample, item, trace_id, run))[0]
        with self.tracing.grade(grader.name, trace_id, run) as span:
            result, flags = await self._grade(grader, sample, item, trace_id, run)
            span.scored(result.score, dict(result.sub_scores), flags)
            return result

    async def _grade(
        self,
        grader: Grader,
        sample: Mapping[str, Any],
        item: Mapping[str, Any],
        trace_id: str | None,
        run: str | None,
    ) -> tuple[GradeResult, list[str]]:
        """The grade and the names of the flags it raised (the grader's own, then the review's)."""
        started = time.perf_counter()
        timeline, inputs = await self.prepare(grader, sample, item, trace_id)
        # The label the rollout's calls carried wins over the grade request's header.
        run = timeline.run if timeline is not None and timeline.run else run
        try:
            result = await grader.grade(inputs)
        except GradingConfigError as exc:
            self.metrics.grades.labels(grader.name, "failed").inc()
            self._report_config_error(grader.name, exc.message)
            await self._store(grader, inputs, None, exc.message, started, run=run, best_effort=False)
            raise GraderMisconfigured(
                f"grader {grader.name!r} cannot grade this item: {exc.message}"
            ) from exc
        except RolloutStateLost as exc:
            self.metrics.grades.labels(grader.name, "refused").inc()
            log.warning("grader %s refused rollout %s: %s", grader.name, trace_id, exc)
            raise RolloutStateGone(str(exc)) from exc
        except GraderUnavailable as exc:
            self.metrics.grades.labels(grader.name, "failed").inc()
            await self._store(grader, inputs, None, str(exc), started, run=run, best_effort=True)
            # The detail (a judge's host, a driver's words) is in the stored grade and the log, not the body.
            log.warning("grader %s unavailable: %s", grader.name, exc)
            raise GradeUnavailable(
                f"grader {grader.name!r} unavailable", retry_after=self.retry_after
            ) from exc
        raised = await self._store(grader, inputs, result, None, started, run=run, best_effort=False)
        self.metrics.grades.labels(grader.name, "ok").inc()
        self.metrics.grade_score.labels(grader.name).observe(result.score)
        return result, [name for name, _ in result.flags] + raised

    async def _store(
        self,
        grader: Grader,
        inputs: GradeInput,
        result: GradeResult | None,
        failure: str | None,
        started: float,
        *,
        run: str | None,
        best_effort: bool,
    ) -> list[str]:
        """Store the grade; the names of the review flags it raised."""
        status = "ok" if result is not None else "failed"
        errors = list(result.errors) if result is not None else [failure or "grader failed"]
        now = datetime.now(UTC)
        try:
            async with self.database.session(write=True) as session:
                # Stored as Postgres text can hold it: a NUL becomes U+FFFD (app/db/text.py).
                _, raised = await store_grade(
                    session,
                    trace_id=storable(inputs.trace_id),
                    calls=inputs.rollout.calls
                    if inputs.rollout is not None
                    else ([] if inputs.trace_id else None),
                    grader=grader.name,
                    grader_version=grader.version,
                    status=status,
                    score=result.score if result is not None else None,
                    sub_scores=storable(dict(result.sub_scores)) if result is not None else {},
                    grader_flags=storable(
                        [
                            {"name": n, "reason": r, "evidence": []}
                            for n, r in (result.flags if result else [])
                        ]
                    ),
                    errors=storable(errors),
                    sample=storable(dict(inputs.sample)),
                    item=storable(dict(inputs.item)),
                    run=storable(run),
                    latency_ms=(time.perf_counter() - started) * 1000,
                    created_at=now,
                    extra_sources=prompt_texts(inputs.item),
                )
        except ServiceUnavailable as exc:
            if best_effort:
                log.warning("could not record a failed grade: %s", exc.message)
                return []
            raise
        for flag in raised:
            self.metrics.flags.labels(flag.name).inc()
        if inputs.trace_id and result is not None:
            try:
                await self.store.mark_graded(inputs.trace_id)
            except ServiceUnavailable as exc:
                # The grade is stored; the state store only uses this mark to expire the rollout sooner.
                log.warning("could not mark rollout %s graded in the state store: %s", inputs.trace_id, exc)
        return [flag.name for flag in raised]

    async def regrade(self, name: str, *, run: str | None = None, limit: int | None = None) -> Regraded:
        """Re-score the latest grade of `name` of each rollout with the current config; store new grades."""
        grader = self.resolve(name)
        async with self.database.session() as session:
            stored = await GradeRepository(session).latest(name, run=run, limit=limit)
        before: list[float] = []
        after: list[float] = []
        changed = failed = skipped = 0
        for old in stored:
            item = old.item or {}
            try:
                result = await self.grade(grader.name, old.sample or {}, item, old.trace_id, run=old.run)
            except RolloutStateGone:
                skipped += 1
                continue
            except GraderMisconfigured:
                failed += 1  # stored as a failed grade, logged by grade()
                continue
            except ServiceUnavailable as exc:
                failed += 1
                log.warning("regrade of %s failed: %s", old.trace_id, exc)
                continue
            # The means compare the rollouts that were regraded, before and after.
            if old.score is not None:
                before.append(old.score)
            after.append(result.score)
            if old.score is None or abs(old.score - result.score) > 1e-9:
                changed += 1
        return Regraded(
            grader=grader.name,
            version=grader.version,
            rollouts=len(stored),
            changed=changed,
            failed=failed,
            skipped=skipped,
            mean_before=_mean(before),
            mean_after=_mean(after),
        )
