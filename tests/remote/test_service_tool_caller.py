"""The remote runner's in-process callers keep the platform's rule: answers go to the model, failures
are tried again with the same call and then discard the rollout, named by their kind (no HTTP status:
nothing went over HTTP)."""

from __future__ import annotations

import time

import httpx

from app.deps import app_state
from app.remote.runner import ServiceGrader, ServiceToolCaller
from app.sdk import Pack, ToolUnavailable
from sparring.http import Retry
from sparring.loop import FunctionCall
from tests.call_log import logged_calls_on
from tests.conftest import AppFactory, new_trace


async def test_answers_pass_through_and_a_crash_is_retried_then_fails_for_good(
    client: httpx.AsyncClient,
) -> None:
    state = app_state(client.app)  # type: ignore[attr-defined]
    caller = ServiceToolCaller(state.call_service, run="remote-test", retry=Retry(attempts=3, delay_s=0))
    trace = new_trace()

    refused = await caller.call(
        FunctionCall(call_id="c1", name="refuse", arguments='{"reason": "no"}'), trace_id=trace, item={}
    )
    assert refused.status is None and refused.attempts == 1 and refused.failure is None
    assert refused.failure_kind is None
    assert refused.output is not None and refused.output.startswith("Error:")

    crashed = await caller.call(
        FunctionCall(call_id="c2", name="crash", arguments="{}"), trace_id=trace, item={}
    )
    assert crashed.output is None and crashed.status is None and crashed.attempts == 3
    assert crashed.failure_kind == "tool_crash"
    assert crashed.failure is not None and crashed.failure.startswith("tool_crash: ")
    assert crashed.failure.endswith("after 3 attempts")

    rows = await logged_calls_on(state.engine, [trace])
    outcomes = {(row["call_id"], row["outcome"]) for row in rows}
    assert {("c1", "model_error"), ("c2", "tool_crash")} <= outcomes


async def test_a_grade_the_server_refuses_is_not_tried_again(client: httpx.AsyncClient) -> None:
    """An unknown grader is a 404 on the grade route: in-process it is `refused` at once, as over HTTP."""
    state = app_state(client.app)  # type: ignore[attr-defined]
    grader = ServiceGrader(
        state.grading, "no-such-grader", run="remote-test", retry=Retry(attempts=3, delay_s=0)
    )
    outcome = await grader.grade({"output_text": "done"}, {}, new_trace())
    assert outcome.score is None and outcome.attempts == 1 and outcome.status == 404  # the route's status
    assert outcome.failure_kind == "refused"
    assert outcome.failure is not None and "no-such-grader" in outcome.failure


down_pack = Pack("down")


@down_pack.tool
def backend_down() -> str:
    """Its backend is always down."""
    raise ToolUnavailable("the backend is down")


async def test_an_outage_is_an_infra_error_tried_again_after_its_retry_after(app_factory: AppFactory) -> None:
    """In-process, as over HTTP: the outage is `infra_error`, and each next try waits its Retry-After
    (2 s here, capped by the retry's 0.3 s; the retry's own delay is 0)."""
    async with app_factory(packs=[down_pack]) as client:
        state = app_state(client.app)  # type: ignore[attr-defined]
        retry = Retry(attempts=3, delay_s=0.0, max_delay_s=0.3)
        caller = ServiceToolCaller(state.call_service, run="remote-test", retry=retry)
        started = time.monotonic()
        down = await caller.call(
            FunctionCall(call_id="c1", name="backend_down", arguments="{}"), trace_id=new_trace(), item={}
        )
        waited = time.monotonic() - started
    assert down.output is None and down.attempts == 3 and down.status is None
    assert down.failure_kind == "infra_error"
    assert down.failure is not None and "the backend is down" in down.failure
    assert waited >= 0.55  # two waits of 0.3 s
