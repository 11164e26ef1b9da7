"""A remote rollout run by the one rollout loop (`sparring.loop.run_rollout`), inside the server.

The model is called at the trainer's base URL (so its tracing proxy records every completion). Tool
calls go to `ToolCallService.handle` in-process, the same service the tool routes call, so
validation, state, exactly-once, the log and the flags are the ones of any other call; the grade at
the end goes to `GradingService.grade`, the service behind the grade routes. Going over HTTP to the
server itself would add a key to hold, a hop per call, and a worker waiting on its own accept queue
under load, for no difference in behaviour. Both keep the client's retry rule
(`sparring.http.with_retries`) and name their failures with its kinds (`tool_crash`, `infra_error`,
`refused`), not with HTTP statuses they never saw.

The model endpoint is the caller's, so it is held to bounds: a deadline on each model call, a byte
cap on its answers (the HTTP client's `CappedAnswers`), and a reason a caller reads that never quotes
what the endpoint answered (the whole failure goes to the server's log).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from app.calls.service import SEND_TO_USER, ToolCallService
from app.errors import ServiceUnavailable, SparringError, ToolCrashed
from app.grading.service import GradingService
from app.packs import Registry
from app.remote.schemas import CODE_INVALID_ARGUMENT, CODE_UNAVAILABLE, RolloutPlan
from app.remote.service import RolloutOutcome
from app.telemetry import Tracing
from app.users.service import scenario_for, with_service_tools
from sparring.conversation import TranscriptStore
from sparring.http import Attempt, Retry, call_with_retries, grade_with_retries
from sparring.loop import (
    USER_KEY,
    DatasetLine,
    EpisodeLimits,
    FunctionCall,
    GradeOutcome,
    ModelFailure,
    ModelTurn,
    Policy,
    RolloutResult,
    ToolResult,
    Transcript,
    run_rollout,
)
from sparring.policies import ChatPolicy, DeadlinePolicy
from sparring.tracing import RUN, RolloutTracing
from sparring.usersim import SimulatedUser
from sparring.wire import INFRA_ERROR, REFUSED, TOOL_CRASH, ToolCallEnvelope

FINAL_TEXT_KEPT = 2000
# Grade failures that are the rollout's configuration (the row, the grader), not an outage: retrying
# the rollout cannot help, so eval-protocol is told INVALID_ARGUMENT rather than UNAVAILABLE.
CONFIGURATION_STATUSES = frozenset({400, 404, 422})
# The loop's discard of a row whose user scenario cannot be played: the row again, never an outage.
USER_SCENARIO_ERROR = "user_error:"

log = logging.getLogger("sparring.remote")


class ServiceToolCaller:
    """The loop's ToolCaller on ToolCallService.handle, with the platform's retry-then-discard rule."""

    def __init__(self, service: ToolCallService, *, run: str | None, retry: Retry | None = None) -> None:
        self.service = service
        self.run = run
        self.retry = retry or Retry()

    async def call(self, call: FunctionCall, *, trace_id: str, item: Mapping[str, Any]) -> ToolResult:
        started = time.perf_counter()
        envelope = ToolCallEnvelope(
            type="function_call",
            id=call.id or f"fc_{call.call_id}",
            call_id=call.call_id,
            name=call.name,
            arguments=call.arguments,
            trace_id=trace_id,
            item=dict(item),
        )

        async def attempt() -> Attempt[str]:
            try:
                answer = (await self.service.call(envelope, path_name=None, run=self.run)).output
            except ServiceUnavailable as exc:  # waits its Retry-After, as the HTTP callers do
                return Attempt(
                    failure=f"{INFRA_ERROR}: {exc.message}", kind=INFRA_ERROR, retry_after_s=exc.retry_after
                )
            except ToolCrashed as exc:
                return Attempt(failure=f"{TOOL_CRASH}: {exc.message}", kind=TOOL_CRASH)
            return Attempt(value=answer.output)

        return await call_with_retries(call, self.retry, attempt, started=started)


# The integers a JSON reader of the routes (orjson) keeps as integers; it reads any other as a float.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def as_the_routes_read(value: Any) -> Any:
    """`value` as the grade route would read it from JSON: an integer past 64 bits (the model's answer,
    parsed by Python's json, may hold one) as a float, as orjson reads it (and can write it), or null
    past the largest double (a number no reader of the routes takes)."""
    if isinstance(value, int) and not isinstance(value, bool) and not _INT_MIN <= value <= _INT_MAX:
        try:
            return float(value)
        except OverflowError:
            return None
    if isinstance(value, Mapping):
        return {key: as_the_routes_read(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [as_the_routes_read(item) for item in value]
    return value


class ServiceGrader:
    """The loop's Grader on GradingService.grade (the grade is stored like any other).

    A grade request larger than the grade routes take (`max_bytes`, SPARRING_MAX_BODY_BYTES) is
    refused here as the route would refuse it (413), so the in-process path stores no more than
    the HTTP one. Only an outage (503) is tried again: any other refusal is final.
    """

    def __init__(
        self,
        service: GradingService,
        name: str,
        *,
        run: str | None,
        retry: Retry | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.service = service
        self.name = name
        self.run = run
        self.retry = retry or Retry()
        self.max_bytes = max_bytes

    async def grade(self, sample: Mapping[str, Any], item: Mapping[str, Any], trace_id: str) -> GradeOutcome:
        sample = as_the_routes_read(sample)
        if self.max_bytes is not None:
            size = len(orjson.dumps({"sample": sample, "item": item, "trace_id": trace_id}))
            if size > self.max_bytes:
                return GradeOutcome(
                    score=None,
                    failure=f"the grade request is {size} bytes, over the {self.max_bytes}-byte limit "
                    "of the grade routes (SPARRING_MAX_BODY_BYTES)",
                    status=413,
                    failure_kind=REFUSED,
                )

        async def attempt() -> Attempt[float]:
            try:
                result = await self.service.grade(self.name, sample, item, trace_id, run=self.run)
            except ServiceUnavailable as exc:  # waits its Retry-After, as the HTTP callers do
                return Attempt(
                    failure=f"{INFRA_ERROR}: {exc.message}", kind=INFRA_ERROR, retry_after_s=exc.retry_after
                )
            except SparringError as exc:
                # A 4xx of the grade route (an unknown grader, a row without the field it reads, state
                # gone): final, and its status tells a configuration error from the rest.
                return Attempt(failure=exc.message, kind=REFUSED, status=exc.status_code)
            return Attempt(value=result.score)

        return await grade_with_retries(self.retry, attempt)


def contained(user: SimulatedUser | None, label: str, *, what: str) -> SimulatedUser | None:
    """`user` for one rollout, its model's failures told in sparring's words (`what` and `label` name
    it in the log)."""
    return None if user is None else replace(user, model=ContainedPolicy(user.model, label, what=what))


class ContainedPolicy:
    """The policy of a remote rollout: the model's failures told in sparring's own words.

    The endpoint is the caller's, and may be a service inside the network answering with its own
    error text; that text goes to the server's log, never into the rollout's reason."""

    def __init__(self, inner: Policy, rollout_id: str, *, what: str = "the model of remote rollout") -> None:
        self.inner = inner
        self.rollout_id = rollout_id
        self.what = what  # how the log names the model and what it served

    async def next_turn(self, transcript: Transcript) -> ModelTurn:
        try:
            return await self.inner.next_turn(transcript)
        except ModelFailure as exc:
            log.warning("%s %s failed: %s", self.what, self.rollout_id, exc)
            raise ModelFailure(exc.brief) from exc


@dataclass(eq=False, kw_only=True)
class RemoteRunner:
    """Turns a checked init request into a rollout of the loop and its outcome."""

    registry: Registry
    calls: ToolCallService
    grading: GradingService
    http: DefaultAsyncHttpxClient
    grader: str | None
    limits: EpisodeLimits
    model_timeout_s: float
    retry: Retry = field(default_factory=Retry)
    grade_max_bytes: int | None = None
    tracing: Tracing | None = None  # None: tracing is off (app/telemetry.py)
    user: SimulatedUser | None = None  # plays the customer of rows with a user scenario (app/users)
    transcripts: TranscriptStore | None = None  # where each rollout's conversation is kept

    def tools_for(self, rollout: RolloutPlan) -> list[dict[str, Any]]:
        """The request's tool schemas (none for `[]`), else every served tool (of the named pack) but
        `send_message_to_user`: in this loop the user answers the agent's messages themselves."""
        if rollout.tools is not None:
            return rollout.tools
        return [
            spec.function_tool()
            for spec in self.registry.tools.values()
            if (rollout.pack is None or spec.pack == rollout.pack) and spec.name != SEND_TO_USER
        ]

    async def execute(self, rollout: RolloutPlan) -> RolloutOutcome:
        model = AsyncOpenAI(
            base_url=rollout.base_url,
            api_key=rollout.api_key or "none",
            http_client=self.http,
            timeout=self.model_timeout_s,
            max_retries=2,
        )
        chat = ChatPolicy(model, rollout.model)
        # Set apart from the constructor's keywords: a sampling key named `client` or `developer_role`
        # is the caller's parameter for the model, not an argument of the policy.
        chat.params = dict(rollout.sampling)
        policy = ContainedPolicy(DeadlinePolicy(chat, self.model_timeout_s), rollout.rollout_id)
        item = {key: value for key, value in (rollout.item or {}).items() if key != USER_KEY}
        # The row's user scenario, else its pack's (only looked up when the server has a user).
        scenario = scenario_for(self.registry, rollout.pack, rollout.item or {}) if self.user else None
        line = DatasetLine(messages=rollout.messages, tools=self.tools_for(rollout), item=item, user=scenario)
        grader = (
            ServiceGrader(
                self.grading, self.grader, run=rollout.run, retry=self.retry, max_bytes=self.grade_max_bytes
            )
            if self.grader is not None and rollout.item is not None
            else None
        )
        result = await run_rollout(
            policy,
            ServiceToolCaller(self.calls, run=rollout.run, retry=self.retry),
            line,
            grader=grader,
            limits=self.limits,
            trace_id=rollout.trace_id,
            tracing=self._tracing(rollout),
            user=with_service_tools(
                contained(self.user, rollout.rollout_id, what="the user model of remote rollout"),
                self.calls,
                pack=rollout.pack,
                run=rollout.run,
                retry=self.retry,
            ),
        )
        if grader is None or result.grade is None:
            # Graded rollouts keep their state with the grade; an ungraded one keeps it at its end, so a
            # grader tried later (`sparring regrade`) can still read it.
            await self.grading.keep_state(rollout.trace_id)
        if self.transcripts is not None:
            await self.transcripts.store(result, model=rollout.model)
        outcome = outcome_of(result, grader=self.grader if grader is not None else None)
        if result.transcript.user is not None and self.user is not None:
            outcome.summary["user_model"] = self.user.name
        return outcome

    def _tracing(self, rollout: RolloutPlan) -> RolloutTracing | None:
        """The rollout as an `invoke_agent` span (under the init request's `traceparent`, if any)."""
        if self.tracing is None:
            return None
        tracing = self.tracing.rollouts(model=rollout.model)
        labels = {"sparring.rollout.id": rollout.rollout_id}
        return tracing.labelled(**labels, **({RUN: rollout.run} if rollout.run else {}))


class GatewayStatusLog:
    """Posts how a rollout ended to eval-protocol's tracing gateway, as a log tagged with its ids.

    eval-protocol 0.3.33's processor learns that a rollout ended from its gateway (`/v1/status`),
    which reads the logs a rollout server posts (`POST <gateway>/logs`, or `/v1/logs`), with the
    trainer's API key. Best effort: a gateway that stays down leaves the processor to its timeout. Each
    post has `timeout_s` to its last byte (the client's read timeout alone bounds only the gap between
    bytes, so a gateway trickling its answer would hold the init, or the rollout's slot, for as long).
    """

    def __init__(
        self,
        http: DefaultAsyncHttpxClient,
        *,
        attempts: int = 3,
        delay_s: float = 0.5,
        timeout_s: float = 10.0,
    ) -> None:
        self.http = http
        self.attempts = attempts
        self.delay_s = delay_s
        self.timeout_s = timeout_s

    async def __call__(self, rollout: RolloutPlan, end: dict[str, Any]) -> None:
        if rollout.status_log_url is None:
            return
        status = end["status"]
        payload = {
            "program": "eval_protocol",
            "status": status,
            "message": f"sparring: {status['message']}",
            "tags": rollout.tags,
            "extras": {
                "trace_id": rollout.trace_id,
                "attempt": rollout.attempt,
                "reward": end.get("reward"),
                "grader": end.get("grader"),
            },
        }
        headers = {"Authorization": f"Bearer {rollout.api_key}"} if rollout.api_key else {}
        urls = [rollout.status_log_url, rollout.status_log_url.removesuffix("/logs") + "/v1/logs"]
        for attempt in range(self.attempts):
            try:
                for url in urls:
                    async with asyncio.timeout(self.timeout_s):
                        response = await self.http.post(
                            url, json=payload, headers=headers, timeout=self.timeout_s
                        )
                    if response.status_code != 404:
                        break
                if response.status_code < 400:
                    return
            except Exception as exc:  # any transport failure: retry, then give up quietly
                log.warning("posting the end of %s to its gateway failed: %s", rollout.rollout_id, exc)
            await asyncio.sleep(self.delay_s * (attempt + 1))
        log.warning("the gateway did not take the end of remote rollout %s", rollout.rollout_id)


def outcome_of(result: RolloutResult, *, grader: str | None) -> RolloutOutcome:
    """Finished (with the reward when graded), or an error with the reason the loop discarded it."""
    summary: dict[str, Any] = {
        "ended_by": result.ended_by,
        "turns": len(result.transcript.steps),
        "tool_calls": len(result.tool_results),
        "tool_errors": result.tool_errors,
        "input_tokens": result.usage.input_tokens,
        "output_tokens": result.usage.output_tokens,
        "duration_s": round(result.duration_s, 3),
        "final_text": result.final_text[:FINAL_TEXT_KEPT],
    }
    if result.discarded is not None:
        # The model endpoint, a tool or the grader failed for good: the trainer should drop it.
        configuration = (
            result.grade is not None and result.grade.status in CONFIGURATION_STATUSES
        ) or result.discarded.startswith(USER_SCENARIO_ERROR)
        code = CODE_INVALID_ARGUMENT if configuration else CODE_UNAVAILABLE
        return RolloutOutcome(
            status="error", code=code, reason=result.discarded, grader=grader, summary=summary
        )
    return RolloutOutcome(status="finished", code=0, reward=result.score, grader=grader, summary=summary)
