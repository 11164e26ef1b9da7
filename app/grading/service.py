"""Grading a rollout: load what the server recorded, run the grader, raise flags, store the grade."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
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
from app.grading.repository import GradeRepository, KeptStateRepository
from app.grounding import prompt_texts
from app.metrics import Metrics
from app.rollouts.shapes import RolloutDetail
from app.rollouts.store import PackChanges, RolloutStore
from app.rollouts.timeline import read_timeline
from app.sdk import GradingConfigError
from app.telemetry import Tracing

log = logging.getLogger(__name__)
# The outcomes of a call after which its rollout's state may hold its writes: answered (or replayed), or
# failed after the store kept them (an infra_error whose log row was voided). A model error, a reused
# call_id, a crash or a refusal kept nothing.
_MAY_HAVE_CHANGED_STATE = frozenset({"ok", "replayed", "infra_error"})


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
    """What `regrade` changed: how many grades, how many scores moved, the means before and after.

    `mean_before` is over the rollouts' grades by the same grader, where they had one.
    """

    grader: str
    version: str
    rollouts: int
    changed: int
    failed: int
    # The grader reads state that neither the state store nor the kept states hold: not regraded.
    skipped: int
    mean_before: float | None
    mean_after: float | None
    ungraded: int = 0  # rollouts of the run nobody graded: no answer is stored to grade them on


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
        # expired or died with its process. (A rollout of stateless tools only never had any; nor one
        # whose state-tool calls all failed before they could change it: refused arguments, a tool's
        # own error or crash. Those are graded on the pack's base state, as the model left it.)
        lost = (
            with_state
            and not state
            and any(
                c.tool in self.state_tools and c.outcome in _MAY_HAVE_CHANGED_STATE for c in timeline.timeline
            )
            and not await self.store.seen(trace_id)
        )
        if lost:  # what an earlier grade kept of it, if any
            async with self.database.session() as session:
                kept = await KeptStateRepository(session).get(storable(trace_id))
            if kept is not None:
                state, lost = kept, False
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
        keep = await self._state_to_keep(grader, inputs)
        now = datetime.now(UTC)
        try:
            async with self.database.session(write=True) as session:
                if keep is not None and inputs.trace_id:
                    await KeptStateRepository(session).keep(storable(inputs.trace_id), storable(keep), at=now)
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

    async def _state_to_keep(self, grader: Grader, inputs: GradeInput) -> PackChanges | None:
        """The rollout's state to keep with its grade; None when the store no longer holds it."""
        record = inputs.rollout
        if record is None or not inputs.trace_id or not any(c.tool in self.state_tools for c in record.calls):
            return None  # no call of a tool that reads or writes state: the rollout has no state to keep
        if grader.needs_rollout:
            if record.state_lost:
                return None
            return {pack: {name: dict(c) for name, c in kept.items()} for pack, kept in record.state.items()}
        try:
            changes = await self.store.changes(inputs.trace_id)
            return changes if changes or await self.store.seen(inputs.trace_id) else None
        except ServiceUnavailable as exc:  # keeping is for later regrades: the grade goes on without it
            log.warning("could not read rollout %s's state to keep it: %s", inputs.trace_id, exc.message)
            return None

    async def keep_state(self, trace_id: str) -> bool:
        """Keep the rollout's state while the store holds it (a rollout this server ran has ended)."""
        try:
            changes = await self.store.changes(trace_id)
            if not changes and not await self.store.seen(trace_id):
                return False
        except ServiceUnavailable as exc:
            log.warning("could not read rollout %s's state to keep it: %s", trace_id, exc.message)
            return False
        try:
            async with self.database.session(write=True) as session:
                await KeptStateRepository(session).keep(
                    storable(trace_id), storable(changes), at=datetime.now(UTC)
                )
        except ServiceUnavailable as exc:  # best effort, as at grade time: the rollout's outcome stands
            log.warning("could not keep rollout %s's state: %s", trace_id, exc.message)
            return False
        return True

    async def regrade_sources(
        self, name: str, *, run: str | None = None, limit: int | None = None
    ) -> tuple[Sequence[Any], int]:
        """What `regrade` would score (a stored grade per rollout, for its sample and row), and how many
        rollouts of the run it cannot (never graded: no answer stored)."""
        self.resolve(name)
        async with self.database.session() as session:
            grades = GradeRepository(session)
            stored = await grades.sources(name, run=run, limit=limit)
            ungraded = await grades.ungraded(run) if run is not None else 0
        return stored, ungraded

    async def regrade(
        self,
        name: str,
        *,
        run: str | None = None,
        limit: int | None = None,
        progress: Callable[[], None] | None = None,
    ) -> Regraded:
        """Score every graded rollout (of `run`) with `name`, whether or not it graded it before; store
        the new grades beside the old. `progress` is called after each rollout."""
        grader = self.resolve(name)
        stored, ungraded = await self.regrade_sources(name, run=run, limit=limit)
        async with self.database.session() as session:
            traced = [g.trace_id for g in stored if g.trace_id]
            previous = {g.trace_id: g.score for g in await GradeRepository(session).latest_of(name, traced)}
        before: list[float] = []
        after: list[float] = []
        outcomes = {"changed": 0, "failed": 0, "skipped": 0}
        for old in stored:
            score = await self._regrade_one(grader, old, outcomes)
            if progress is not None:
                progress()
            if score is None:
                continue
            old_score = previous.get(old.trace_id) if old.trace_id else old.score
            # The means compare the rollouts that were regraded, before and after.
            if old_score is not None:
                before.append(old_score)
            after.append(score)
            if old_score is None or abs(old_score - score) > 1e-9:
                outcomes["changed"] += 1
        return Regraded(
            grader=grader.name,
            version=grader.version,
            rollouts=len(stored),
            mean_before=_mean(before),
            mean_after=_mean(after),
            ungraded=ungraded,
            **outcomes,
        )

    async def _regrade_one(self, grader: Grader, old: Any, outcomes: dict[str, int]) -> float | None:
        """The new score of one rollout; None (counted in `outcomes`) when it could not be graded."""
        try:
            result = await self.grade(
                grader.name, old.sample or {}, old.item or {}, old.trace_id, run=old.run
            )
        except RolloutStateGone:
            outcomes["skipped"] += 1
            return None
        except GraderMisconfigured:
            outcomes["failed"] += 1  # stored as a failed grade, logged by grade()
            return None
        except ServiceUnavailable as exc:
            outcomes["failed"] += 1
            log.warning("regrade of %s failed: %s", old.trace_id, exc)
            return None
        return result.score
