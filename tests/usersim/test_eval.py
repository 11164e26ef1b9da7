"""`sparring eval --user-model` against a served retail pack: the simulated user holds the conversation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sparring.usersim import STOP
from tests.runner.model_server import ModelRequest, ModelServer, Reply, Unavailable
from tests.runner.test_cli import retail_data, run_cli, servers, sparring, train, write_lines
from tests.runner.test_retail import GoldModel, with_writes_and_facts
from tests.system.helpers import Server

__all__ = ["retail_data", "servers", "sparring", "train"]


FOLLOW_UP = "One more question: can I also change the address later?"


def opening(line: dict[str, Any]) -> str:
    return f"Hello, I need help with task {line['task_id']}."


class Conversation:
    """The agent plays each task's gold calls, then states its facts; the user opens with the task it
    read in its scenario, and ends the conversation once the agent has answered."""

    def __init__(self, raw: list[dict[str, Any]], *, follow_up: bool = False) -> None:
        self.agent = GoldModel(raw)
        self.agent.by_user = {opening(line): line for line in raw}
        self.raw = raw
        # The user asks one more thing after the facts: the agent's last message then states none.
        self.replies = [FOLLOW_UP] if follow_up else []

    def __call__(self, request: ModelRequest) -> Reply:
        if request.model == "down":
            raise Unavailable
        if request.model != "user":
            return Reply(text="Anything else I can do?") if request.user == FOLLOW_UP else self.agent(request)
        (line,) = [
            line
            for line in self.raw
            if line["user_simulator"]["scenario"]["instructions"]["reason_for_call"] in request.system
        ]
        answered = sum(1 for m in request.body["messages"] if m["role"] == "assistant")
        replies = [opening(line), *self.replies, f"Thank you! {STOP}"]
        return Reply(text=replies[min(answered, len(replies) - 1)])


@pytest.mark.parametrize("follow_up", [False, True])
async def test_eval_with_a_user_model_grades_the_conversation_and_names_the_user(
    sparring: Server, model_server: ModelServer, train: list[dict[str, Any]], tmp_path: Path, follow_up: bool
) -> None:
    raw = with_writes_and_facts(train, 2)
    model_server.script = Conversation(raw, follow_up=follow_up)
    dataset = write_lines(tmp_path / "retail.jsonl", raw)
    out = tmp_path / "report.json"
    done = await run_cli(
        tmp_path,
        "eval", "--dataset", str(dataset), "--model", "agent", "--base-url", model_server.base_url,
        "--api", "chat", "--server", sparring.url, "--grader", "retail", "--samples", "1",
        "--user-model", "user", "--user-base-url", model_server.base_url, "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["user_model"] == "user"
    assert "user model" in done.stdout
    assert report["rollouts"]["graded"] == 2 and report["reward"]["mean"] == 1.0
    users = [request for request in model_server.requests if request.model == "user"]
    assert len(users) == (6 if follow_up else 4)  # an opening (a follow-up) and a stop per rollout
    assert all(request.body["temperature"] == 0.0 for request in users)


async def test_a_user_model_that_fails_discards_the_rollouts_with_its_reason(
    sparring: Server, model_server: ModelServer, train: list[dict[str, Any]], tmp_path: Path
) -> None:
    raw = with_writes_and_facts(train, 1)
    model_server.script = Conversation(raw)
    dataset = write_lines(tmp_path / "retail.jsonl", raw)
    out = tmp_path / "report.json"
    done = await run_cli(
        tmp_path,
        "eval", "--dataset", str(dataset), "--model", "agent", "--base-url", model_server.base_url,
        "--api", "chat", "--server", sparring.url, "--grader", "retail", "--samples", "1",
        "--user-model", "down", "--user-base-url", model_server.base_url, "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["rollouts"]["discarded"] == 1
    (reason,) = report["rollouts"]["discarded_by_reason"]
    assert reason.startswith("user_model_error")
    assert [request.model for request in model_server.requests] == ["down"] * len(model_server.requests)
