"""τ²'s `TOO_MANY_ERRORS`: a conversation ends once the tool calls of both sides gave `max_errors` errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from openai import AsyncOpenAI

from sparring.loop import FunctionCall, ToolResult, run_rollout
from sparring.policies import ChatPolicy
from sparring.usersim import DEFAULT_MAX_ERRORS, STOP, SimulatedUser
from tests.runner.model_server import Call, ModelServer, Reply
from tests.tau2_reference import use_reference
from tests.usersim.test_loop import AGENT, USER, by_model, retail_line, scripted, simulated_user

WRONG = "Error: User not found"


class Tools:
    """Tools answering by name: `wrong` with an error, any other with a record; every call recorded."""

    def __init__(self, rows: str = "{}") -> None:
        self.calls: list[str] = []
        self.rows = rows

    def schemas(self, scenario: Mapping[str, Any]) -> list[dict[str, Any]]:
        # Offered to a user, so its calls of them run (a call of a tool not offered runs nothing).
        return [{"type": "function", "function": {"name": name}} for name in ("wrong", "right")]

    async def call(self, call: FunctionCall, *, trace_id: str, item: Mapping[str, Any]) -> ToolResult:
        self.calls.append(call.name)
        return ToolResult(call=call, output=WRONG if call.name == "wrong" else self.rows)


def test_the_default_limit_is_tau2s() -> None:
    use_reference()
    from tau2.config import DEFAULT_MAX_ERRORS as TAU2_MAX_ERRORS

    assert DEFAULT_MAX_ERRORS == TAU2_MAX_ERRORS
    assert SimulatedUser(model=None, name=USER).max_errors == TAU2_MAX_ERRORS  # type: ignore[arg-type]


async def test_each_erroring_call_counts_and_the_batch_reaching_the_limit_ends_the_episode(
    model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    # Each agent turn makes one wrong call and one right one: the third turn's results reach 3 errors,
    # and the episode ends before the agent reads them.
    both = (Call("wrong", {}), Call("right", {}))
    model_server.script = scripted(agent=[Reply(calls=both)] * 5, user=[Reply(text="Hello.")])
    tools = Tools()
    result = await run_rollout(
        ChatPolicy(openai_client, AGENT),
        tools,
        retail_line(),
        user=simulated_user(openai_client, max_errors=3),
    )
    assert result.ended_by == "too_many_errors"
    assert result.discarded is None
    assert tools.calls == ["wrong", "right"] * 3
    assert len(by_model(model_server, AGENT)) == 3


async def test_calls_without_errors_never_end_the_episode(
    model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    right = Reply(calls=(Call("right", {}),))
    model_server.script = scripted(
        agent=[right] * 4 + [Reply(text="Done.")], user=[Reply(text="Hello."), Reply(text=f"Bye. {STOP}")]
    )
    tools = Tools()
    result = await run_rollout(
        ChatPolicy(openai_client, AGENT),
        tools,
        retail_line(),
        user=simulated_user(openai_client, max_errors=1),
    )
    assert result.ended_by == "user_stop"
    assert tools.calls == ["right"] * 4


async def test_the_users_errors_and_the_agents_count_together(
    model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    # The user's phone call errs (1) before it writes; the agent's call errs (2): the limit of 2 ends it.
    model_server.script = scripted(
        agent=[Reply(calls=(Call("wrong", {}),)), Reply(text="unread")],
        user=[Reply(calls=(Call("wrong", {}),)), Reply(text="My phone is broken."), Reply(text="unread")],
    )
    phone, carrier = Tools(), Tools()
    result = await run_rollout(
        ChatPolicy(openai_client, AGENT),
        carrier,
        retail_line(),
        user=simulated_user(openai_client, tools=phone, max_errors=2),
    )
    assert result.ended_by == "too_many_errors"
    assert phone.calls == ["wrong"] and carrier.calls == ["wrong"]
    assert len(by_model(model_server, USER)) == 2 and len(by_model(model_server, AGENT)) == 1


async def test_the_users_own_errors_end_the_episode_inside_its_turn(
    model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    model_server.script = scripted(agent=[Reply(text="unread")], user=[Reply(calls=(Call("wrong", {}),))] * 3)
    phone = Tools()
    result = await run_rollout(
        ChatPolicy(openai_client, AGENT),
        Tools(),
        retail_line(),
        user=simulated_user(openai_client, tools=phone, max_errors=2),
    )
    assert result.ended_by == "too_many_errors"
    assert phone.calls == ["wrong", "wrong"]
    assert by_model(model_server, AGENT) == []
