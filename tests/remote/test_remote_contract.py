"""The remote rollout contract, driven as eval-protocol's processor drives it, against a scripted model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from app.deps import app_state
from app.remote.repository import RemoteRolloutRepository
from app.remote.schemas import trace_id_for
from app.remote.service import RemoteRolloutService
from tests.conftest import ADMIN_KEY, AppFactory
from tests.remote.model_server import ModelServer, Turn
from tests.remote.processor import Row, init_request, post_init, wait_gateway_status, wait_terminated

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
USER = [{"role": "user", "content": "Add 2, then 3, then tell me the counter."}]


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    server.scripts["adder"] = [
        Turn(calls=[("increment", {"by": 2, "name": None})]),
        Turn(calls=[("increment", {"by": 3, "name": None}), ("read_counter", {"name": None})]),
        Turn(text="The counter is 105."),
    ]
    server.start()
    yield server
    server.stop()


def tracing_url(model: ModelServer, row: Row) -> str:
    """A base URL with the rollout's ids in its path, as eval-protocol builds for its tracing proxy."""
    return model.tracing_url(row.rollout_id, row.row_id)


async def test_a_rollout_runs_in_the_background_and_its_calls_are_in_the_log(
    app_factory: AppFactory, model: ModelServer
) -> None:
    row = Row.new()
    async with app_factory() as client:
        body = init_request(row, model="adder", model_base_url=tracing_url(model, row), messages=USER)
        accepted = await post_init(client, "/remote", body)
        assert accepted.status_code == 200, accepted.text
        assert accepted.json()["trace_id"] == trace_id_for(row.rollout_id)

        status = await wait_terminated(client, "/remote", row.rollout_id)
        assert status["state"] == "finished" and status["reason"] is None
        assert status["status"]["code"] == 100  # eval-protocol's FINISHED
        assert status["trace_id"] == trace_id_for(row.rollout_id)
        assert status["info"]["tool_calls"] == 3 and status["info"]["turns"] == 3
        assert status["info"]["final_text"] == "The counter is 105."
        assert status["reward"] is None  # no grader configured

        # The model was called at the trainer's URL, so its tracing proxy saw every completion.
        path = tracing_url(model, row).split(f":{model.port}/", 1)[1]
        assert model.prefixes.count(path) == 3

        # The calls are sparring's own: in the log under the trace id, labelled with the run.
        logged = await client.get(f"/rollouts/{status['trace_id']}", headers=ADMIN)
        assert logged.status_code == 200, logged.text
        calls = logged.json()["timeline"]
        assert [c["tool"] for c in calls] == ["increment", "increment", "read_counter"]
        assert [c["output"] for c in calls][:2] == ['{"value":102}', '{"value":105}']
        # The server ran the loop, so it kept the conversation: each turn, its calls by call_id.
        transcript = logged.json()["transcript"]
        assert transcript["model"] == "adder" and transcript["source"] == "remote"
        assistant = [m for m in transcript["messages"] if m["role"] == "assistant"]
        assert [len(m["tool_calls"]) for m in assistant] == [1, 2, 0]
        assert [c["call_id"] for m in assistant for c in m["tool_calls"]] == [c["call_id"] for c in calls]
        assert assistant[-1]["content"] == "The counter is 105."
        recent = await client.get("/rollouts", params={"run": "exp-1:run-1"}, headers=ADMIN)
        assert status["trace_id"] in [r["trace_id"] for r in recent.json()["rollouts"]]


async def test_the_end_is_posted_to_the_tracing_gateway_the_0_3_33_processor_polls(
    app_factory: AppFactory, model: ModelServer
) -> None:
    done, failed = Row.new(), Row.new()
    async with app_factory() as client:
        for row, name in ((done, "adder"), (failed, "down")):
            body = init_request(row, model=name, model_base_url=tracing_url(model, row), messages=USER)
            assert (await post_init(client, "/remote", body)).status_code == 200
        gateway = model.base_url("").rstrip("/")
        finished = await wait_gateway_status(gateway, done.rollout_id)
        error = await wait_gateway_status(gateway, failed.rollout_id)
    assert finished == {"code": 100, "message": "Rollout finished", "details": []}
    assert error["code"] == 14 and error["message"].startswith("model_error:")
    posted = next(log for log in model.logs if f"rollout_id:{done.rollout_id}" in log["tags"])
    assert posted["program"] == "eval_protocol"
    assert set(posted["tags"]) == {f"rollout_id:{done.rollout_id}", "experiment_id:exp-1", "run_id:run-1"}
    assert posted["extras"]["trace_id"] == trace_id_for(done.rollout_id)
    index = model.logs.index(posted)
    assert model.log_headers[index]["authorization"] == "Bearer trainer-model-key"


async def test_a_repeated_init_does_not_run_the_rollout_twice(
    app_factory: AppFactory, model: ModelServer
) -> None:
    row = Row.new()
    async with app_factory() as client:
        body = init_request(row, model="adder", model_base_url=model.base_url(), messages=USER)
        first, second = await asyncio.gather(
            post_init(client, "/remote", body), post_init(client, "/remote", body)
        )
        assert first.status_code == second.status_code == 200
        assert sorted([first.json()["started"], second.json()["started"]]) == [False, True]
        status = await wait_terminated(client, "/remote", row.rollout_id)
        assert status["info"]["tool_calls"] == 3
        logged = await client.get(f"/rollouts/{status['trace_id']}", headers=ADMIN)
        assert len(logged.json()["timeline"]) == 3


async def test_a_failing_model_server_makes_the_rollout_an_error_with_the_reason(
    app_factory: AppFactory, model: ModelServer
) -> None:
    row = Row.new()
    async with app_factory() as client:
        body = init_request(row, model="down", model_base_url=model.base_url(), messages=USER)
        assert (await post_init(client, "/remote", body)).status_code == 200
        status = await wait_terminated(client, "/remote", row.rollout_id)
    assert status["state"] == "error"
    assert status["terminated"] is True
    assert status["reason"].startswith("model_error:") and "503" in status["reason"]
    assert status["status"]["code"] == 14  # UNAVAILABLE: eval-protocol retries the rollout
    assert status["status"]["message"] == status["reason"]
    assert status["reward"] is None


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_fifty_concurrent_rollouts_each_with_its_own_state(
    app_factory: AppFactory, model: ModelServer
) -> None:
    rows = [Row.new(row_id=f"row-{i}") for i in range(50)]
    async with app_factory(remote_max_concurrent=50) as client:
        bodies = [
            init_request(r, model="adder", model_base_url=model.base_url(), messages=USER) for r in rows
        ]
        accepted = await asyncio.gather(*(post_init(client, "/remote", b) for b in bodies))
        assert [a.status_code for a in accepted] == [200] * 50
        statuses = await asyncio.gather(*(wait_terminated(client, "/remote", r.rollout_id) for r in rows))
    assert {s["state"] for s in statuses} == {"finished"}
    # Every rollout saw only its own counter: 100 + 2 + 3 in each.
    assert {s["info"]["final_text"] for s in statuses} == {"The counter is 105."}
    assert len({s["trace_id"] for s in statuses}) == 50


async def test_a_full_worker_answers_503_with_retry_after(
    app_factory: AppFactory, model: ModelServer
) -> None:
    held, extra = Row.new(), Row.new()
    async with app_factory(remote_max_concurrent=1) as client:
        body = init_request(held, model="hold", model_base_url=model.base_url(), messages=USER)
        assert (await client.post("/remote/init", json=body)).status_code == 200
        full = await client.post(
            "/remote/init",
            json=init_request(extra, model="adder", model_base_url=model.base_url(), messages=USER),
        )
        assert full.status_code == 503
        assert full.headers["retry-after"] == "2"
        assert full.json()["error"]["code"] == "remote_rollouts_full"
        # The refused rollout was not recorded: the processor's retry starts it cleanly later.
        unknown = await client.get("/remote/status", params={"rollout_id": extra.rollout_id})
        assert unknown.status_code == 404
        model.release()
        await wait_terminated(client, "/remote", held.rollout_id)
        again = await post_init(
            client,
            "/remote",
            init_request(extra, model="adder", model_base_url=model.base_url(), messages=USER),
        )
        assert again.status_code == 200
        assert (await wait_terminated(client, "/remote", extra.rollout_id))["state"] == "finished"


async def test_a_restart_mid_rollout_reports_an_error_never_finished(
    app_factory: AppFactory, model: ModelServer
) -> None:
    row = Row.new()
    hold = init_request(row, model="hold", model_base_url=tracing_url(model, row), messages=USER)
    async with app_factory() as client:
        assert (await client.post("/remote/init", json=hold)).status_code == 200
        running = (await client.get("/remote/status", params={"rollout_id": row.rollout_id})).json()
        assert running["terminated"] is False and running["status"]["code"] == 101
    # The worker stopped with the rollout in flight; a new one (same database) reports it.
    async with app_factory() as client:
        status = (await client.get("/remote/status", params={"rollout_id": row.rollout_id})).json()
        assert status["terminated"] is True and status["state"] == "error"
        assert "shut down" in status["reason"]
        assert status["status"]["code"] == 10  # ABORTED
    # The stopping worker told the tracing gateway too, so the 0.3.33 processor does not wait it out.
    told = await wait_gateway_status(model.base_url("").rstrip("/"), row.rollout_id)
    assert told["code"] == 10 and "shut down" in told["message"]


async def test_bad_init_requests_are_4xx_with_what_is_missing(app_factory: AppFactory) -> None:
    row = Row.new()
    async with app_factory() as client:
        no_model = init_request(row, model="", model_base_url="http://127.0.0.1:9/v1", messages=USER)
        answer = await client.post("/remote/init", json=no_model)
        assert answer.status_code == 400 and "model" in answer.json()["error"]["message"]
        no_url = init_request(row, model="adder", model_base_url="", messages=USER)
        answer = await client.post("/remote/init", json=no_url)
        assert answer.status_code == 400 and "base URL" in answer.json()["error"]["message"]
        no_id: dict[str, Any] = init_request(row, model="adder", model_base_url="http://x/v1", messages=USER)
        no_id["metadata"] = {}
        answer = await client.post("/remote/init", json=no_id)
        assert answer.status_code == 400 and "rollout id" in answer.json()["error"]["message"]
    async with app_factory(key=None) as anonymous:
        assert (await anonymous.post("/remote/init", json=no_model)).status_code == 401


async def test_an_open_prefix_takes_no_key_and_the_default_prefix_is_gone(
    app_factory: AppFactory, model: ModelServer
) -> None:
    prefix = "/remote/0123456789abcdef0123456789abcdef"
    row = Row.new()
    async with app_factory(key=None, remote_open=True, remote_prefix=prefix) as client:
        body = init_request(row, model="adder", model_base_url=model.base_url(), messages=USER)
        assert (await client.post(f"{prefix}/init", json=body)).status_code == 200
        assert (await wait_terminated(client, prefix, row.rollout_id))["state"] == "finished"
        assert (await client.post("/remote/init", json=body)).status_code == 404


def test_an_open_prefix_must_be_secret() -> None:
    from pydantic import ValidationError

    from app.config import Settings

    with pytest.raises(ValidationError, match="SPARRING_REMOTE_PREFIX"):
        Settings(remote_open=True)


async def test_status_of_an_unknown_rollout_is_404(client: httpx.AsyncClient) -> None:
    answer = await client.get("/remote/status", params={"rollout_id": "nope"})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


async def test_a_rollout_whose_lease_lapsed_reads_as_an_error(app_factory: AppFactory) -> None:
    """What a killed worker leaves: a running row nobody renews. Fresh leases stay running."""
    lapsed, fresh = Row.new(), Row.new()
    async with app_factory() as client:
        service: RemoteRolloutService = app_state(client.app).remote  # type: ignore[attr-defined]
        now = datetime.now(UTC)
        async with service.database.session(write=True) as session:
            for row, lease in ((lapsed, now - timedelta(seconds=1)), (fresh, now + timedelta(minutes=5))):
                claimed = await RemoteRolloutRepository(session).claim(
                    {
                        "rollout_id": row.rollout_id,
                        "trace_id": trace_id_for(row.rollout_id),
                        "run": None,
                        "model": "m",
                        "status": "running",
                        "summary": {},
                        "request": {},
                        "worker": "killed:1",
                        "lease_until": lease,
                        "created_at": now - timedelta(minutes=1),
                    }
                )
                assert claimed
        status = (await client.get("/remote/status", params={"rollout_id": lapsed.rollout_id})).json()
        assert status["state"] == "error" and status["status"]["code"] == 10
        assert "stopped (restart or crash)" in status["reason"]
        still = (await client.get("/remote/status", params={"rollout_id": fresh.rollout_id})).json()
        assert still["state"] == "running" and still["terminated"] is False
