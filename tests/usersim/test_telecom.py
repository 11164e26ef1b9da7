"""A telecom line's simulated user: τ²'s prompt for a user with tools, and the phone's tools it calls."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from sparring.http import as_transport
from sparring.usersim import HttpUserTools, SimulatedUser
from tests.telecom import corpus
from tests.usersim.reference import telecom_user
from tools.telecom.dataset import build_dataset
from tools.telecom.tasks import Split


def telecom_lines(split: Split = "test") -> list[dict[str, Any]]:
    return build_dataset(corpus.fetch(), split)


@pytest.mark.parametrize("index", [0, 7])
async def test_a_telecom_user_gets_tau2s_prompt_and_its_phone_tools(index: int) -> None:
    line = telecom_lines()[index]
    async with httpx.AsyncClient() as client:
        tools = HttpUserTools(as_transport(client), "http://sparring.invalid", {})
        user = SimulatedUser(model=None, name="user", tools=tools)  # type: ignore[arg-type]
        conversation = user.start(line["user_simulator"], {"task_id": line["task_id"]}, "trace")
    assert conversation is not None
    prompt, schemas = telecom_user(line["task_id"])
    # The `_tools` guidelines, then the task's scenario, exactly as τ²'s UserSimulator writes them.
    assert conversation.prompt == prompt
    assert conversation.prompt.startswith(line["user_simulator"]["guidelines_tools"].strip())
    request = conversation.request()
    assert request.messages == [{"role": "system", "content": prompt}]
    # The user model is offered the phone's tools, as τ² offers them: names, order, descriptions, arguments.
    assert [tool["function"]["name"] for tool in request.tools] == [s["function"]["name"] for s in schemas]
    for ours, theirs in zip(request.tools, schemas, strict=True):
        assert ours["function"]["description"] == theirs["function"]["description"]
        assert (
            ours["function"]["parameters"]["properties"].keys()
            == theirs["function"]["parameters"]["properties"].keys()
        )
        assert sorted(ours["function"]["parameters"].get("required", [])) == sorted(
            theirs["function"]["parameters"].get("required", [])
        )
