"""A telecom remote rollout with the server's simulated user: the user fixes its phone with its own tools,
run in process on the call path of /user-tools (logged on the channel `user`, ids `user_...`), and
/grade/telecom grades both sides' final state (1.0 with every fix, 0.0 with the user's fix left out)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sparring.wire import USER_CALL_PREFIX
from tests.conftest import ADMIN_KEY, AppFactory
from tests.remote.model_server import ModelServer, Turn
from tests.remote.processor import Row, init_request, post_init, wait_terminated
from tests.telecom import corpus
from tests.usersim.telecom_script import ASK, DONE, FAREWELL, OPENING, SOLVED, TASK
from tools.telecom import pack
from tools.telecom.dataset import build_dataset


def scripts(omitted: str | None) -> tuple[list[Turn], list[Turn]]:
    """The agent's and the user's turns: each side plays its gold calls (but `omitted`) in τ²'s order.
    The agent's requests hold τ²'s greeting as their first turn: its script starts one turn later."""
    gold = [call for call in corpus.gold_calls(TASK) if call[1] != omitted]
    user = [Turn(text=OPENING), *(Turn(calls=[(n, a)]) for s, n, a in gold if s == "user"), Turn(text=DONE)]
    user.append(Turn(text=FAREWELL))
    agent = [Turn(text="unused"), Turn(text=ASK)]
    agent += [Turn(calls=[(n, a)]) for s, n, a in gold if s == "assistant"]
    agent.append(Turn(text=SOLVED))
    return agent, user


@pytest.fixture(scope="module")
def line() -> dict[str, Any]:
    (found,) = [line for line in build_dataset(corpus.fetch(), "test") if line["task_id"] == TASK]
    return found


@pytest.fixture(scope="module")
def model() -> Iterator[ModelServer]:
    server = ModelServer()
    for omitted in (None, "toggle_data_saver_mode"):
        agent, user = scripts(omitted)
        server.scripts[f"agent-{omitted}"], server.scripts[f"user-{omitted}"] = agent, user
    server.start()
    yield server
    server.stop()


async def timeline(client: httpx.AsyncClient, trace_id: str) -> list[dict[str, Any]]:
    detail = await client.get(f"/review/api/rollouts/{trace_id}")
    assert detail.status_code == 200, detail.text
    return list(detail.json()["timeline"])


@pytest.mark.parametrize("backend", ["real"], indirect=True)
@pytest.mark.parametrize(("omitted", "reward"), [(None, 1.0), ("toggle_data_saver_mode", 0.0)])
async def test_the_servers_user_fixes_its_phone_with_its_own_tools_and_the_rollout_is_graded(
    app_factory: AppFactory,
    model: ModelServer,
    line: dict[str, Any],
    telecom_data: Path,
    omitted: str | None,
    reward: float,
) -> None:
    assert omitted is None or omitted in {name for _, name, _ in corpus.gold_calls(TASK)}
    row = Row.new()
    item = {k: v for k, v in line.items() if k not in ("messages", "tools")}
    async with app_factory(
        packs=[pack],
        key=ADMIN_KEY,
        remote_grader="telecom",
        pack_settings={"telecom": {"data": telecom_data}},
        user_model=f"user-{omitted}",
        user_base_url=model.base_url(),
        remote_allowed_hosts=["127.0.0.1"],
    ) as client:
        body = init_request(
            row, model=f"agent-{omitted}", model_base_url=model.base_url(), messages=line["messages"],
            tools=line["tools"], item=item,
        )  # fmt: skip
        accepted = await post_init(client, "/remote", body)
        assert accepted.status_code == 200, accepted.text
        status = await wait_terminated(client, "/remote", row.rollout_id)
        assert status["state"] == "finished", status
        assert status["reward"] == reward
        assert status["info"]["ended_by"] == "user_stop" and status["info"]["user_model"] == f"user-{omitted}"
        calls = await timeline(client, status["trace_id"])

    # The user's calls ran on its phone under the rollout's trace, on the channel `user`, their ids
    # prefixed; the agent's on the tool routes' channel.
    phone = [name for side, name, _ in corpus.gold_calls(TASK) if side == "user" and name != omitted]
    users = [c for c in calls if c["channel"] == "user"]
    assert [c["tool"] for c in users] == phone
    assert all(c["call_id"].startswith(USER_CALL_PREFIX) and c["outcome"] == "ok" for c in users)
    agents = [c for c in calls if c["channel"] != "user"]
    assert [c["tool"] for c in agents] == ["enable_roaming"]
    assert not any(c["call_id"].startswith(USER_CALL_PREFIX) for c in agents)
    # Their results went back to the user, never to the agent.
    requests = model._model.requests
    user_reads = [m for r in requests if r.model == f"user-{omitted}" for m in r.body["messages"]]
    assert any("Airplane Mode is now OFF" in str(m.get("content")) for m in user_reads if m["role"] == "tool")
    agent_reads = [m for r in requests if r.model == f"agent-{omitted}" for m in r.body["messages"]]
    assert agent_reads and not any("Airplane Mode is now OFF" in str(m.get("content")) for m in agent_reads)
