"""Runs remote rollouts in the background, bounded per worker, with their state kept in the database.

A rollout's row is its truth: `running` while a worker holds its lease (renewed every third of
SPARRING_REMOTE_LEASE_SECONDS), then `finished` or `error` with a reason. A worker that stops marks
its rollouts as errors on the way out; one that dies stops renewing, and the first status read (or
any worker's start-up) after the lease lapses marks the rollout as an error. Nothing is ever
reported finished that did not finish.

eval-protocol retries a rollout that failed with a new init under the same rollout id: the row is
then the rollout's current attempt, and a retry of one whose last attempt failed starts the next
attempt, on a trace (so a state) of its own; a running or finished rollout is never started again.
Each attempt tells the gateway it runs before its init answers, and one that runs past
SPARRING_REMOTE_DEADLINE_SECONDS is stopped and ends as a deadline failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from app.db.models import RemoteRollout
from app.db.session import Database
from app.db.text import storable
from app.errors import BadRequest, NotFound, ServiceUnavailable
from app.remote.egress import EgressRule, RefusedDestination
from app.remote.repository import RemoteRolloutRepository
from app.remote.schemas import (
    CODE_ABORTED,
    CODE_DEADLINE_EXCEEDED,
    CODE_FINISHED,
    CODE_INTERNAL,
    CODE_RUNNING,
    InitRequest,
    RolloutPlan,
    plan,
)

log = logging.getLogger("sparring.remote")

LOST = "the worker running this rollout stopped (restart or crash) before it ended"
STOPPED = "the worker running this rollout shut down before it ended"


class RemoteFull(ServiceUnavailable):
    """Every remote rollout slot of this worker is taken: the processor retries /init later."""

    code = "remote_rollouts_full"


@dataclass
class RolloutOutcome:
    """How a rollout ended: `finished` (with a reward when it was graded) or `error` with a reason."""

    status: str
    code: int
    reason: str | None = None
    reward: float | None = None
    grader: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)


Execute = Callable[[RolloutPlan], Awaitable[RolloutOutcome]]
# Tells the trainer's side how a rollout ended (eval-protocol's tracing gateway); never raises.
Report = Callable[[RolloutPlan, dict[str, Any]], Awaitable[None]]


def status_of(status: str, code: int, reason: str | None) -> dict[str, Any]:
    """The AIP-193 status eval-protocol reads: FINISHED, RUNNING, or the error's code and reason."""
    if status == "finished":
        return {"code": CODE_FINISHED, "message": "Rollout finished", "details": []}
    if status == "running":
        return {"code": CODE_RUNNING, "message": "Rollout is running", "details": []}
    return {"code": code, "message": reason or "Rollout failed", "details": []}


def _now() -> datetime:
    return datetime.now(UTC)


class RemoteRolloutService:
    def __init__(
        self,
        *,
        database: Database,
        execute: Execute,
        worker: str,
        max_concurrent: int,
        lease_seconds: float,
        retry_after: int,
        deadline_seconds: float = 120.0,
        report: Report | None = None,
        egress: EgressRule | None = None,
    ) -> None:
        self.database = database
        self.egress = egress or EgressRule()
        self.execute = execute
        self.report = report
        self.worker = worker
        self.max_concurrent = max_concurrent
        self.lease = timedelta(seconds=lease_seconds)
        self.retry_after = retry_after
        self.deadline_s = deadline_seconds
        self._slots = 0
        self._tasks: dict[tuple[str, int], asyncio.Task[None]] = {}  # by rollout id and attempt
        self._plans: dict[str, RolloutPlan] = {}
        self._heartbeat: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Fail what earlier workers left running past their lease, then keep this worker's leases."""
        # A database down at start-up: the first status read of each rollout fails it instead.
        with contextlib.suppress(ServiceUnavailable):
            async with self.database.session(write=True) as session:
                lost = await RemoteRolloutRepository(session).fail_lost(_now(), LOST)
            if lost:
                log.warning("marked %d remote rollouts of stopped workers as errors", lost)
        self._heartbeat = asyncio.create_task(self._renew_leases(), name="remote-rollout-leases")

    async def aclose(self) -> None:
        """Stop this worker's rollouts and record them as errors: a restart never finishes them."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        running = sorted({rollout_id for rollout_id, _ in self._tasks})
        plans = list(self._plans.values())
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if running:
            with contextlib.suppress(ServiceUnavailable):  # past their lease they read as lost anyway
                async with self.database.session(write=True) as session:
                    await RemoteRolloutRepository(session).fail_worker(self.worker, running, STOPPED, _now())
            if self.report is not None:
                stopped = status_of("error", CODE_ABORTED, STOPPED)
                await asyncio.gather(*(self.report(plan, {"status": stopped}) for plan in plans))

    @property
    def in_flight(self) -> int:
        return self._slots

    async def init(self, init: InitRequest) -> dict[str, Any]:
        """Accept a rollout and start an attempt of it in the background: the first, or the next one
        when its last attempt failed (eval-protocol's retry). A finished rollout is never run again,
        and a running one is not started twice, however many inits arrive at once."""
        rollout = plan(init)
        await self._check_destinations(rollout)
        if self._slots >= self.max_concurrent:
            raise RemoteFull(
                f"this worker already runs {self.max_concurrent} remote rollouts; retry shortly",
                retry_after=self.retry_after,
            )
        self._slots += 1
        started: RolloutPlan | None = None
        try:
            current, started = await self._claim(rollout)
            if started is not None:
                self._plans[rollout.rollout_id] = started  # its lease is renewed from now on
                await self._announce(started)
        finally:
            if started is None:
                self._slots -= 1
            else:  # even when the answer is cancelled: the claimed attempt runs and ends
                task = asyncio.create_task(self._run(started), name=f"remote-rollout-{rollout.rollout_id}")
                self._tasks[(rollout.rollout_id, started.attempt)] = task
        return {
            "rollout_id": rollout.rollout_id,
            "trace_id": current.trace_id,
            "run": current.run,
            "accepted": True,
            "started": started is not None,
            "attempt": current.attempt,
        }

    async def _claim(self, rollout: RolloutPlan) -> tuple[RemoteRollout | RolloutPlan, RolloutPlan | None]:
        """The rollout's current attempt, and the plan of the attempt this init starts (None when it
        starts none: the rollout runs, or it finished)."""
        if rollout.rollout_id in self._plans:  # running here: its lease is being renewed
            return self._plans[rollout.rollout_id], None
        if await self._write(lambda repo: repo.claim(self._row(rollout))):
            return rollout, rollout
        async with self.database.session(write=True) as session:
            repo = RemoteRolloutRepository(session)
            if await repo.fail_lost(_now(), LOST, rollout.rollout_id):
                log.warning("remote rollout %s had lost its worker", rollout.rollout_id)
        async with self.database.session() as session:
            row = await RemoteRolloutRepository(session).get(rollout.rollout_id)
        if row is None or row.status != "error":  # running, or finished: never run again
            return row or rollout, None
        retry = rollout.as_attempt(row.attempt + 1)
        fields = {k: v for k, v in self._row(retry).items() if k != "rollout_id"}
        if await self._write(lambda repo: repo.retry(row, fields)):
            return retry, retry
        async with self.database.session() as session:  # a concurrent init started it first
            return (await RemoteRolloutRepository(session).get(rollout.rollout_id)) or retry, None

    async def _write(self, statement: Callable[[RemoteRolloutRepository], Awaitable[bool]]) -> bool:
        async with self.database.session(write=True) as session:
            return await statement(RemoteRolloutRepository(session))

    def _row(self, rollout: RolloutPlan) -> dict[str, Any]:
        now = _now()
        return {
            "rollout_id": rollout.rollout_id,
            "trace_id": rollout.trace_id,
            "run": rollout.run,
            "model": rollout.model[:200],
            "status": "running",
            "summary": {},
            "request": rollout.stored_request(),
            "worker": self.worker,
            "lease_until": now + self.lease,
            "created_at": now,
        }

    async def _announce(self, rollout: RolloutPlan) -> None:
        """Tell the gateway the attempt runs before /init answers: eval-protocol's processor reads the
        latest status of the rollout id there, which would otherwise be the failed attempt's."""
        if self.report is not None:
            await self.report(rollout, {"status": status_of("running", CODE_RUNNING, None)})

    async def _check_destinations(self, rollout: RolloutPlan) -> None:
        """Refuse (400) URLs the server must not send to: the HTTP client checks every request again,
        this tells the caller now instead of through a failed rollout."""
        try:
            await self.egress.check(rollout.base_url, "model base URL")
            if rollout.status_log_url is not None:
                await self.egress.check(rollout.status_log_url, "status log URL")
        except RefusedDestination as exc:
            raise BadRequest(str(exc)) from exc

    async def _run(self, rollout: RolloutPlan) -> None:
        try:
            outcome = await self._outcome(rollout)
            await self._record(rollout, outcome)
            # Ended: an init from now on may start the next attempt, while this one's end is reported.
            self._release(rollout)
            if self.report is not None:
                await self.report(
                    rollout,
                    {
                        "status": status_of(outcome.status, outcome.code, outcome.reason),
                        "reward": outcome.reward,
                        "grader": outcome.grader,
                    },
                )
        finally:
            self._release(rollout)
            self._tasks.pop((rollout.rollout_id, rollout.attempt), None)
            self._slots -= 1

    def _release(self, rollout: RolloutPlan) -> None:
        """Stop holding the attempt `rollout` (its lease, its place in `_claim`), unless a later attempt
        of the rollout already holds them."""
        if self._plans.get(rollout.rollout_id) is rollout:
            del self._plans[rollout.rollout_id]

    async def _outcome(self, rollout: RolloutPlan) -> RolloutOutcome:
        """Run the attempt to its end, or stop it at the deadline (whose trainer no longer waits)."""
        try:
            async with asyncio.timeout(self.deadline_s) as deadline:
                return await self.execute(rollout)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            if not deadline.expired():
                raise
            log.warning("remote rollout %s ran past its deadline and was stopped", rollout.rollout_id)
            return RolloutOutcome(
                status="error",
                code=CODE_DEADLINE_EXCEEDED,
                reason=f"deadline: the rollout ran past SPARRING_REMOTE_DEADLINE_SECONDS "
                f"({self.deadline_s:g} s) and was stopped",
            )
        except Exception as exc:  # a bug in the runner: the rollout failed, the worker goes on
            log.exception("remote rollout %s crashed", rollout.rollout_id)
            # The exception's text stays in the log: it may quote what the model endpoint sent.
            return RolloutOutcome(
                status="error",
                code=CODE_INTERNAL,
                reason=f"internal error ({type(exc).__name__}); the server's log has the detail",
            )

    async def _record(self, rollout: RolloutPlan, outcome: RolloutOutcome) -> None:
        # As Postgres can hold it (NUL as U+FFFD): the model's final text is in the summary, and an
        # outcome that cannot be stored leaves the rollout running until its lease lapses.
        summary = storable({**outcome.summary, "status_code": outcome.code})
        for attempt in range(3):
            try:
                async with self.database.session(write=True) as session:
                    await RemoteRolloutRepository(session).finish(
                        rollout.rollout_id,
                        attempt=rollout.attempt,
                        worker=self.worker,
                        status=outcome.status,
                        reason=storable(outcome.reason),
                        reward=outcome.reward,
                        grader=outcome.grader,
                        summary=summary,
                        at=_now(),
                    )
                return
            except ServiceUnavailable:
                # The lease keeps the row running meanwhile; past it, the rollout reads as lost.
                log.warning("cannot record remote rollout %s (try %d)", rollout.rollout_id, attempt + 1)
                await asyncio.sleep(0.5 * (attempt + 1))

    async def _renew_leases(self) -> None:
        interval = self.lease.total_seconds() / 3
        while True:
            await asyncio.sleep(interval)
            ids = list(self._plans)
            if not ids:
                continue
            try:
                async with self.database.session(write=True) as session:
                    await RemoteRolloutRepository(session).renew(self.worker, ids, _now() + self.lease)
            except ServiceUnavailable:
                log.warning("cannot renew the leases of %d remote rollouts", len(ids))

    async def status(self, rollout_id: str) -> dict[str, Any]:
        async with self.database.session(write=True) as session:
            repo = RemoteRolloutRepository(session)
            row = await repo.get(rollout_id)
            if row is not None and row.status == "running" and row.lease_until < _now():
                await repo.fail_lost(_now(), LOST, rollout_id)
                row = await repo.get(rollout_id)  # None: `sparring prune` deleted it meanwhile
            if row is None:
                raise NotFound(f"no remote rollout {rollout_id!r}")
            return render_status(row)


def render_status(row: RemoteRollout) -> dict[str, Any]:
    """eval-protocol's StatusResponse (`terminated`, `status`, `info`) plus sparring's own fields."""
    summary = dict(row.summary or {})
    code = summary.pop("status_code", None)
    status = status_of(row.status, code if isinstance(code, int) else CODE_ABORTED, row.reason)
    info: dict[str, Any] = {
        "trace_id": row.trace_id,
        "attempt": row.attempt,
        "earlier_attempts": list(row.earlier or []),
        "run": row.run,
        "state": row.status,
        "reason": row.reason,
        "reward": row.reward,
        "grader": row.grader,
        **summary,
    }
    return {
        "terminated": row.status != "running",
        "rollout_id": row.rollout_id,
        "trace_id": row.trace_id,
        "attempt": row.attempt,
        "state": row.status,
        "reason": row.reason,
        "reward": row.reward,
        "status": status,
        "info": info,
    }
