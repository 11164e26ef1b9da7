"""Remote rollouts of retail tasks with the server's simulated user (SPARRING_USER_MODEL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparring.usersim import GREETING, STOP
from tests.conftest import AppFactory
from tests.remote.model_server import ModelServer, Turn
from tests.remote.processor import Row, init_request, post_init, wait_terminated
from tests.retail.corpus import build_dataset
from tests.retail.gold import gold_turns
from tools.retail import pack

TASK = "1"
OPENING = "Hello, I need to change something in my order."


@pytest.fixture(scope="module")
def line() -> dict[str, Any]:
    return next(line for line in build_dataset("train") if line["task_id"] == TASK)


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    # The agent's requests hold τ²'s greeting as its first turn: its script starts one turn later.
    server.scripts["gold"] = [Turn(text="unused"), *gold_turns(TASK)]
    server.scripts["user"] = [Turn(text=OPENING), Turn(text=f"Thank you. {STOP}")]
    server.start()
    yield server
    server.stop()


async def run_one(
    app_factory: AppFactory, retail_data: Path, line: dict[str, Any], agent_url: str, **settings: Any
) -> Any:
    row = Row.new()
    item = {k: v for k, v in line.items() if k not in ("messages", "tools")}
    async with app_factory(
        packs=[pack], remote_grader="retail", pack_settings={"retail": {"data": retail_data}}, **settings
    ) as client:
        body = init_request(
            row, model="gold", model_base_url=agent_url, messages=line["messages"],
            tools=line["tools"], item=item,
        )  # fmt: skip
        accepted = await post_init(client, "/remote", body)
        assert accepted.status_code == 200, accepted.text
        return await wait_terminated(client, "/remote", row.rollout_id)


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_a_remote_rollout_holds_the_conversation_with_the_servers_user(
    app_factory: AppFactory, model: ModelServer, line: dict[str, Any], retail_data: Path
) -> None:
    status = await run_one(
        app_factory, retail_data, line, agent_url=model.base_url(), user_model="user",
        user_base_url=model.base_url(), remote_allowed_hosts=["127.0.0.1"],
    )  # fmt: skip
    assert status["state"] == "finished", status
    assert status["reward"] == 1.0
    users = [r for r in model._model.requests if r.model == "user"]
    assert len(users) == 2 and "<scenario>" in users[0].system
    assert users[0].body["messages"][1:] == [{"role": "user", "content": GREETING}]
    agents = [r for r in model._model.requests if r.model == "gold"]
    assert agents[0].body["messages"][1:] == [
        {"role": "assistant", "content": GREETING},
        {"role": "user", "content": OPENING},
    ]


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_a_conversation_that_runs_out_of_steps_is_rewarded_0_as_tau2_rewards_it(
    app_factory: AppFactory, model: ModelServer, line: dict[str, Any], retail_data: Path
) -> None:
    # The user's opening (1), each turn of gold calls and its results (2 each), the agent's answer: the
    # step limit is reached there, before the user could stop. The database and the facts are right,
    # but τ²-bench's evaluator rewards a simulation that ended by MAX_STEPS 0.
    calls = sum(1 for turn in gold_turns(TASK) if turn.calls)
    status = await run_one(
        app_factory, retail_data, line, agent_url=model.base_url(), user_model="user",
        user_base_url=model.base_url(), remote_allowed_hosts=["127.0.0.1"], user_max_steps=2 * calls + 2,
    )  # fmt: skip
    assert status["state"] == "finished", status
    assert status["reward"] == 0.0, status


@pytest.mark.parametrize("backend", ["real"], indirect=True)
@pytest.mark.parametrize(("user_model", "allowed"), [("down", ["127.0.0.1"]), ("user", [])])
async def test_a_user_model_outage_or_a_refused_host_ends_the_rollout_as_an_error_not_a_5xx(
    app_factory: AppFactory,
    model: ModelServer,
    line: dict[str, Any],
    retail_data: Path,
    user_model: str,
    allowed: list[str],
) -> None:
    # Refused: the agent's model is reached through a name the egress rule was told to allow, while
    # the user model's loopback address is not allowed.
    agent_url = model.base_url() if allowed else model.base_url().replace("127.0.0.1", "localhost")
    status = await run_one(
        app_factory, retail_data, line, agent_url=agent_url, user_model=user_model,
        user_base_url=model.base_url(), remote_allowed_hosts=allowed or ["localhost"],
    )  # fmt: skip
    assert status["state"] == "error", status
    expected = (
        "user_model_error: the model endpoint answered HTTP 503"
        if allowed
        else "user_model_error: the remote rollout's URL reaches a non-public address; "
        "an operator may allow its host in SPARRING_REMOTE_ALLOWED_HOSTS"
    )
    assert status["reason"] == status["status"]["message"] == expected
    assert status["info"]["user_model"] == user_model and status["info"]["turns"] == 0
