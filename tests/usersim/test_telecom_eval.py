"""A telecom task end to end through `sparring eval`: a scripted agent calls the carrier's tools, a scripted
user calls its phone's tools at /user-tools, the user ends with ###STOP###, and /grade/telecom grades the
rollout's final state (1.0 with every fix, 0.0 with one left out)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL
from tests.runner.model_server import Call, ModelRequest, ModelServer, Reply
from tests.runner.test_cli import run_cli, servers, write_lines
from tests.system.helpers import Server, Servers, server_settings
from tests.telecom import corpus
from tests.telecom.corpus import Call as GoldCall
from tests.usersim.telecom_script import ASK, DONE, FAREWELL, OPENING, SOLVED, TASK
from tools.telecom.dataset import build_dataset

__all__ = ["servers"]


@pytest.fixture
async def telecom_server(servers: Servers, pg_database: str, tmp_path: Path) -> Server:
    settings = server_settings(
        database_url=pg_database,
        redis_url=REDIS_URL,
        home=tmp_path / "server-home",
        worker="usersim-telecom",
        SPARRING_PACKS="telecom",
        SPARRING_TELECOM_DATA=str(corpus.fetch()),
    )
    return await servers.start("telecom", settings)


def reply(call: GoldCall) -> Reply:
    _, name, arguments = call
    return Reply(calls=(Call(name, arguments),))


class Episode:
    """The agent and the user play the task's gold calls of their side (but `omitted`) in τ²'s order:
    the agent asks the user to fix the phone, the user does and says so, the agent fixes the carrier's
    side and asks, the user ends the conversation."""

    def __init__(self, omitted: str | None) -> None:
        gold = [call for call in corpus.gold_calls(TASK) if call[1] != omitted]
        self.user = [Reply(text=OPENING), *(reply(c) for c in gold if c[0] == "user"), Reply(text=DONE)]
        self.user.append(Reply(text=FAREWELL))
        self.agent = [Reply(text=ASK), *(reply(c) for c in gold if c[0] == "assistant"), Reply(text=SOLVED)]

    def __call__(self, request: ModelRequest) -> Reply:
        turns = self.user if request.model == "user" else self.agent
        played = sum(1 for m in request.body["messages"] if m.get("role") == "assistant")
        if request.model != "user":
            played -= 1  # the greeting is the agent's, already in its request
        return turns[played]


@pytest.mark.parametrize(
    ("omitted", "reward", "ids_per_answer"),
    [
        (None, 1.0, False),
        ("enable_roaming", 0.0, False),
        ("toggle_data_saver_mode", 0.0, False),
        (None, 1.0, True),
    ],
    ids=["every-fix", "no-roaming-at-the-carrier", "data-saver-left-on", "call-ids-numbered-per-answer"],
)
async def test_a_telecom_episode_through_eval_is_graded_on_both_sides_final_state(
    telecom_server: Server,
    model_server: ModelServer,
    tmp_path: Path,
    omitted: str | None,
    reward: float,
    ids_per_answer: bool,
) -> None:
    """With `ids_per_answer`, the agent and the user models both name their first call of every answer
    `call_0`: each call is still applied once, under an id of its own in the rollout."""
    (line,) = [line for line in build_dataset(corpus.fetch(), "test") if line["task_id"] == TASK]
    assert omitted is None or omitted in {name for _, name, _ in corpus.gold_calls(TASK)}
    model_server.script = Episode(omitted)
    model_server.ids_per_answer = ids_per_answer
    dataset = write_lines(tmp_path / "telecom.jsonl", [line])
    out = tmp_path / "report.json"
    done = await run_cli(
        tmp_path,
        "eval", "--dataset", str(dataset), "--model", "agent", "--base-url", model_server.base_url,
        "--api", "chat", "--server", telecom_server.url, "--grader", "telecom", "--samples", "1",
        "--user-model", "user", "--user-base-url", model_server.base_url, "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["user_model"] == "user"
    assert report["rollouts"]["graded"] == 1 and report["reward"]["mean"] == reward
    assert report["rollouts"]["ended_by"] == {"user_stop": 1}
    users = [request for request in model_server.requests if request.model == "user"]
    # Every user turn was offered the phone's tools; the last one ended the conversation.
    phone_tools = [tool["function"]["name"] for tool in line["user_simulator"]["tools"]]
    assert all(request.tools == phone_tools for request in users)
    assert users[-1].body["messages"][-1]["content"] == SOLVED
    # The user's calls ran on its phone (their answers went back to it), the agent never saw them.
    phone = [name for request in users for _, name, _ in request.calls]
    expected = [name for side, name, _ in corpus.gold_calls(TASK) if side == "user" and name != omitted]
    assert list(dict.fromkeys(phone)) == expected
    assert any("Airplane Mode is now OFF" in output for _, output in users[-1].outputs)
    agents = [request for request in model_server.requests if request.model == "agent"]
    assert {name for request in agents for _, name, _ in request.calls} <= {"enable_roaming"}
    assert not any("Status Bar" in output for request in agents for _, output in request.outputs)
    assert [m["content"] for m in agents[-1].body["messages"] if m["role"] == "user"] == [OPENING, DONE]
