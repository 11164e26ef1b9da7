"""eval-protocol's retries (a new init under the same rollout id) and the remote rollout's deadline.

A retry of a rollout whose last attempt failed runs as a new attempt on a trace of its own; a finished
rollout and a running one are not started again, however many inits arrive at once (two workers on one
database here); each attempt posts RUNNING to the gateway before its init answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.remote.schemas import trace_id_for
from tests.conftest import ADMIN_KEY, AppFactory
from tests.remote.model_server import ModelServer, Turn
from tests.remote.processor import Row, init_request, post_init, wait_gateway_status, wait_terminated

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
USER = [{"role": "user", "content": "Add 2, then 3, then tell me the counter."}]
ADDER = [
    Turn(calls=[("increment", {"by": 2, "name": None})]),
    Turn(calls=[("increment", {"by": 3, "name": None}), ("read_counter", {"name": None})]),
    Turn(text="The counter is 105."),
]


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    server.scripts["adder"] = ADDER
    server.scripts["flaky"] = ADDER
    server.start()
    yield server
    server.stop()


def body(model: ModelServer, row: Row, name: str) -> dict[str, Any]:
    """An init as the processor sends it, with the tracing gateway's model URL for the rollout."""
    return init_request(row, model=name, model_base_url=model.tracing_url(row.rollout_id), messages=USER)


async def outputs(client: httpx.AsyncClient, trace_id: str) -> list[str]:
    logged = await client.get(f"/rollouts/{trace_id}", headers=ADMIN)
    assert logged.status_code == 200, logged.text
    return [call["output"] for call in logged.json()["timeline"]]


def gateway_codes(model: ModelServer, row: Row) -> list[tuple[int, int]]:
    """(status code, attempt) of every log posted for the rollout, in order."""
    return [(log["status"]["code"], log["extras"]["attempt"]) for log in model.tagged(row.rollout_id)]


async def test_a_retry_of_a_failed_rollout_runs_a_new_attempt_on_fresh_state(
    app_factory: AppFactory, model: ModelServer
) -> None:
    row = Row.new()
    async with app_factory() as client:
        first = (await post_init(client, "/remote", body(model, row, "flaky"))).json()
        assert first["started"] is True and first["attempt"] == 1
        failed = await wait_terminated(client, "/remote", row.rollout_id)
        assert failed["state"] == "error" and failed["status"]["code"] == 14
        # The first attempt changed its state (the counter is at 102) before the model failed.
        assert await outputs(client, trace_id_for(row.rollout_id)) == ['{"value":102}']

        again = (await post_init(client, "/remote", body(model, row, "flaky"))).json()
        assert again["started"] is True and again["attempt"] == 2
        assert again["trace_id"] == trace_id_for(row.rollout_id, 2) != trace_id_for(row.rollout_id)
        status = await wait_terminated(client, "/remote", row.rollout_id)
        assert status["state"] == "finished" and status["status"]["code"] == 100
        assert status["attempt"] == status["info"]["attempt"] == 2
        assert status["trace_id"] == again["trace_id"]
        # A fresh state: 100 + 2 + 3, not the first attempt's counter carried on.
        assert (await outputs(client, again["trace_id"]))[:2] == ['{"value":102}', '{"value":105}']
        [earlier] = status["info"]["earlier_attempts"]
        assert earlier["attempt"] == 1 and earlier["trace_id"] == trace_id_for(row.rollout_id)
        assert earlier["state"] == "error" and earlier["status_code"] == 14
        assert earlier["reason"] == failed["reason"]
    # Each attempt told the gateway it runs before its init answered, then how it ended.
    assert gateway_codes(model, row) == [(101, 1), (14, 1), (101, 2), (100, 2)]
    end = model.tagged(row.rollout_id)[-1]
    assert end["extras"]["trace_id"] == trace_id_for(row.rollout_id, 2)


async def test_a_finished_rollout_is_not_run_again(app_factory: AppFactory, model: ModelServer) -> None:
    row = Row.new()
    async with app_factory() as client:
        assert (await post_init(client, "/remote", body(model, row, "adder"))).json()["started"] is True
        done = await wait_terminated(client, "/remote", row.rollout_id)
        assert done["state"] == "finished"
        completions = len(model.prefixes)
        again = await post_init(client, "/remote", body(model, row, "adder"))
        assert again.status_code == 200, again.text
        assert again.json()["started"] is False and again.json()["attempt"] == 1
        assert again.json()["trace_id"] == done["trace_id"]
        status = (await client.get("/remote/status", params={"rollout_id": row.rollout_id})).json()
        assert status == done
        assert len(model.prefixes) == completions  # the model was not called again
        assert len(await outputs(client, done["trace_id"])) == 3
    assert gateway_codes(model, row) == [(101, 1), (100, 1)]


async def test_a_running_rollout_is_not_started_twice(app_factory: AppFactory, model: ModelServer) -> None:
    row = Row.new()
    async with app_factory() as client:
        assert (await post_init(client, "/remote", body(model, row, "stall"))).json()["started"] is True
        again = (await post_init(client, "/remote", body(model, row, "stall"))).json()
        assert again["started"] is False and again["attempt"] == 1
        status = (await client.get("/remote/status", params={"rollout_id": row.rollout_id})).json()
        assert status["state"] == "running" and status["attempt"] == 1
    assert gateway_codes(model, row)[0] == (101, 1)


async def test_a_retry_while_the_failed_attempts_end_is_being_posted_starts_the_next_attempt(
    app_factory: AppFactory, model: ModelServer
) -> None:
    row = Row.new()
    slow_gateway = {"status_log_url": model.base_url("held/logs")}
    model.hold_logs()
    async with app_factory() as client:
        first = (await post_init(client, "/remote", body(model, row, "down") | slow_gateway)).json()
        assert first["started"] is True and first["attempt"] == 1
        # The attempt is recorded as failed; its end is still on its way to the gateway.
        assert (await wait_terminated(client, "/remote", row.rollout_id))["state"] == "error"
        retried = (await post_init(client, "/remote", body(model, row, "adder") | slow_gateway)).json()
        model.release_logs()
        assert retried["started"] is True and retried["attempt"] == 2
        status = await wait_terminated(client, "/remote", row.rollout_id)
        assert status["state"] == "finished" and status["attempt"] == 2


async def test_concurrent_retries_on_two_workers_start_exactly_one_attempt(
    app_factory: AppFactory, model: ModelServer
) -> None:
    row = Row.new()
    async with app_factory() as one, app_factory() as two:
        assert (await post_init(one, "/remote", body(model, row, "down"))).json()["started"] is True
        assert (await wait_terminated(one, "/remote", row.rollout_id))["state"] == "error"
        retry = body(model, row, "adder")
        answers = await asyncio.gather(*(post_init(worker, "/remote", retry) for worker in (one, two) * 6))
        assert [a.status_code for a in answers] == [200] * 12
        assert sorted(a.json()["started"] for a in answers) == [False] * 11 + [True]
        assert {a.json()["attempt"] for a in answers} == {2}
        assert {a.json()["trace_id"] for a in answers} == {trace_id_for(row.rollout_id, 2)}
        status = await wait_terminated(one, "/remote", row.rollout_id)
        assert status["state"] == "finished" and status["attempt"] == 2
        assert len(status["info"]["earlier_attempts"]) == 1
        assert len(await outputs(one, status["trace_id"])) == 3
    assert [code for code, _ in gateway_codes(model, row)] == [101, 14, 101, 100]


async def test_a_rollout_past_its_deadline_is_stopped_and_can_be_retried(
    app_factory: AppFactory, model: ModelServer
) -> None:
    row = Row.new()
    async with app_factory(remote_deadline_seconds=0.5) as client:
        assert (await post_init(client, "/remote", body(model, row, "stall"))).json()["started"] is True
        stopped = await wait_terminated(client, "/remote", row.rollout_id)
        assert stopped["state"] == "error"
        assert stopped["status"]["code"] == 4  # DEADLINE_EXCEEDED: eval-protocol retries it
        assert "SPARRING_REMOTE_DEADLINE_SECONDS" in stopped["reason"]
        told = await wait_gateway_status(model.base_url("").rstrip("/"), row.rollout_id)
        assert told["code"] == 4 and told["message"].endswith(stopped["reason"])
        retried = (await post_init(client, "/remote", body(model, row, "adder"))).json()
        assert retried["started"] is True and retried["attempt"] == 2
        assert (await wait_terminated(client, "/remote", row.rollout_id))["state"] == "finished"


def test_the_default_deadline_is_eval_protocols_timeout() -> None:
    from app.config import Settings

    assert Settings().remote_deadline_seconds == 120.0
