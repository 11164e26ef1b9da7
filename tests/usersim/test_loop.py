"""The rollout loop with a simulated user: τ²'s prompts, the role flip, the user's tools, the stops."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from sparring.conversation import conversation_of
from sparring.http import as_transport
from sparring.loop import DatasetLine, FunctionCall, ToolResult, run_rollout
from sparring.policies import ChatPolicy
from sparring.usersim import GREETING, OUT_OF_SCOPE, STOP, TRANSFER, USER_ROLE, HttpUserTools, SimulatedUser
from tests.retail import corpus
from tests.runner.model_server import Call, ModelRequest, ModelServer, Reply
from tests.usersim.reference import requests_of, tau2_user

AGENT, USER = "agent", "user"


class NoCalls:
    """The agent's tools in tests where the agent only talks: any call fails the test."""

    async def call(self, call: FunctionCall, *, trace_id: str, item: Mapping[str, Any]) -> ToolResult:
        raise AssertionError(f"the agent called {call.name}")


class PhoneTools:
    """A user's own tools (as telecom's device tools would be), recording every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.items: list[dict[str, Any]] = []

    def schemas(self, scenario: Mapping[str, Any]) -> list[dict[str, Any]]:
        return list(scenario.get("tools") or [])

    async def call(self, call: FunctionCall, *, trace_id: str, item: Mapping[str, Any]) -> ToolResult:
        self.calls.append((call.name, trace_id))
        self.items.append(dict(item))
        return ToolResult(call=call, output='{"airplane_mode": false}')


def retail_line(task_id: str = "0") -> DatasetLine:
    corpus.fetch()
    return DatasetLine.from_json(
        next(line for line in corpus.build_dataset("train") if line["task_id"] == task_id)
    )


def by_model(model_server: ModelServer, name: str) -> list[ModelRequest]:
    return [request for request in model_server.requests if request.model == name]


def sent(request: ModelRequest) -> list[dict[str, Any]]:
    """A request's messages as τ² would compare them: without the keys left empty."""
    return [{k: v for k, v in m.items() if v is not None} for m in request.body["messages"]]


def simulated_user(openai_client: AsyncOpenAI, **kwargs: Any) -> SimulatedUser:
    return SimulatedUser(model=ChatPolicy(openai_client, USER, temperature=0.0), name=USER, **kwargs)


def scripted(agent: list[Reply], user: list[Reply]) -> Any:
    """Agent and user answers in turn, each by how many of its own turns its request already holds."""

    def script(request: ModelRequest) -> Reply:
        turns = agent if request.model == AGENT else user
        played = sum(1 for m in request.body["messages"] if m.get("role") == "assistant")
        if request.model == AGENT:
            played -= 1  # the greeting is the agent's, already in its request
        return turns[played]

    return script


async def test_the_user_model_gets_tau2s_prompt_and_the_flipped_conversation(
    model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    line = retail_line("0")
    opening, stop = "Hi, I'd like to exchange two items of an order.", f"Thanks, that's all. {STOP}"
    ask = "Sure. Could you tell me your name and zip code?"
    model_server.script = scripted(agent=[Reply(text=ask)], user=[Reply(text=opening), Reply(text=stop)])

    result = await run_rollout(
        ChatPolicy(openai_client, AGENT), NoCalls(), line, user=simulated_user(openai_client)
    )

    assert result.ended_by == "user_stop"
    assert result.discarded is None
    assert result.final_text == ask
    # The grader reads every message the agent wrote, as τ²'s communicate check does.
    assert result.sample is not None and result.sample["output_text"] == f"{GREETING}\n{ask}"
    scenario = line.user["scenario"]
    expected = requests_of(scenario, [GREETING, ask], [opening, stop])
    users = by_model(model_server, USER)
    assert [sent(request) for request in users] == [
        [{k: v for k, v in m.items() if v is not None} for m in turn] for turn in expected
    ]
    assert all(request.body["temperature"] == 0.0 and "tools" not in request.body for request in users)
    # The agent reads its prompt, the greeting and the user's message: never the user's own prompt.
    (agent,) = by_model(model_server, AGENT)
    assert [m["role"] for m in agent.body["messages"]] == ["system", "assistant", "user"]
    assert agent.body["messages"][1:] == [
        {"role": "assistant", "content": GREETING},
        {"role": "user", "content": opening},
    ]
    assert "<scenario>" not in json.dumps(agent.body)
    assert result.transcript.user is not None
    assert [m["role"] for m in result.transcript.user.messages] == ["assistant", USER_ROLE] * 2
    # The stored conversation (the review's) says whose turn each was, the stop message included.
    stored = conversation_of(result)["messages"]
    assert [m["role"] for m in stored] == [
        "system",
        "assistant",
        "simulated_user",
        "assistant",
        "simulated_user",
    ]
    assert [m["content"] for m in stored[1:]] == [GREETING, opening, ask, stop]


def test_a_user_with_tools_gets_the_tools_guidelines_as_tau2_gives_them() -> None:
    corpus.fetch()
    from sparring.usersim import system_prompt
    from tools.retail.data import read_user_guidelines

    scenario = retail_line("0").user["scenario"]
    for tools in (False, True):
        with tau2_user(scenario, user_tools=tools) as user:
            assert (
                system_prompt(read_user_guidelines(corpus.DATA_DIR, tools=tools), scenario)
                == user.system_prompt
            )


async def test_the_users_tool_calls_run_on_its_side_and_the_agent_never_sees_them(
    model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    plain = retail_line("0")
    toggle = {
        "type": "function",
        "function": {"name": "toggle_airplane_mode", "parameters": {"type": "object"}},
    }
    line = replace(plain, user={**plain.user, "tools": [toggle], "guidelines_tools": "TOOLS"})
    model_server.script = scripted(
        agent=[Reply(text="Please turn airplane mode off."), Reply(text="Great, anything else?")],
        user=[
            Reply(text="My phone has no service."),
            Reply(calls=(Call("toggle_airplane_mode", {}),)),
            Reply(text="Done, it works now."),
            Reply(text=STOP),
        ],
    )
    phone = PhoneTools()

    result = await run_rollout(
        ChatPolicy(openai_client, AGENT), NoCalls(), line, user=simulated_user(openai_client, tools=phone)
    )

    assert result.ended_by == "user_stop"
    assert phone.calls == [("toggle_airplane_mode", result.trace_id)]
    assert phone.items == [line.item] and "user_simulator" not in line.item  # the row, without the scenario
    users = by_model(model_server, USER)
    assert all(request.tools == ["toggle_airplane_mode"] for request in users)
    assert all(request.system.startswith("TOOLS\n\n<scenario>") for request in users)
    after_call = sent(users[2])
    assert after_call[-2]["role"] == "assistant" and after_call[-2]["tool_calls"][0]["function"]["name"] == (
        "toggle_airplane_mode"
    )
    assert after_call[-1] == {
        "role": "tool",
        "tool_call_id": after_call[-2]["tool_calls"][0]["id"],
        "content": '{"airplane_mode": false}',
    }
    last_agent = by_model(model_server, AGENT)[-1]
    assert last_agent.body["messages"][-1] == {"role": "user", "content": "Done, it works now."}
    assert "toggle_airplane_mode" not in json.dumps(last_agent.body["messages"])
    roles = [m["role"] for m in result.transcript.user.messages] if result.transcript.user else []
    assert roles == [
        "assistant",
        USER_ROLE,
        "assistant",
        USER_ROLE,
        "tool",
        USER_ROLE,
        "assistant",
        USER_ROLE,
    ]


@pytest.mark.parametrize(
    ("offered", "called", "answer"),
    [
        ([], "toggle_airplane_mode", "Error: User tools not available"),  # a retail customer
        (["toggle_airplane_mode"], "reboot_device", "Error: Tool 'reboot_device' not found."),
    ],
)
async def test_a_user_call_of_a_tool_it_was_not_given_runs_nothing_and_gets_tau2s_error(
    model_server: ModelServer, openai_client: AsyncOpenAI, offered: list[str], called: str, answer: str
) -> None:
    """Sent on, the call would reach any enabled pack's user tool of that name (a retail customer's
    made-up `toggle_airplane_mode` toggling telecom's phone on the rollout's state)."""
    plain = retail_line("0")
    tools = [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in offered
    ]
    line = replace(plain, user={**plain.user, "tools": tools, "guidelines_tools": "TOOLS"})
    model_server.script = scripted(
        agent=[Reply(text="Please turn airplane mode off."), Reply(text="Great, anything else?")],
        user=[
            Reply(text="My phone has no service."),
            Reply(calls=(Call(called, {}),)),
            Reply(text="Done."),
            Reply(text=STOP),
        ],
    )
    phone = PhoneTools()
    user = simulated_user(openai_client, tools=phone)

    result = await run_rollout(ChatPolicy(openai_client, AGENT), NoCalls(), line, user=user)

    assert result.ended_by == "user_stop" and phone.calls == []
    after_call = sent(by_model(model_server, USER)[2])
    assert after_call[-1]["role"] == "tool" and after_call[-1]["content"] == answer
    assert result.transcript.user is not None and result.transcript.user.errors == 1


class SlowPhone(PhoneTools):
    """A phone whose calls take a moment: what runs while another call is still running shows."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    async def call(self, call: FunctionCall, *, trace_id: str, item: Mapping[str, Any]) -> ToolResult:
        self.events.append(f"start {call.name}")
        await asyncio.sleep(0.01)
        self.events.append(f"end {call.name}")
        return ToolResult(call=call, output=f"{call.name} done")


async def test_a_user_turn_of_several_calls_runs_them_one_after_another_in_order(
    model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    """τ²'s orchestrator answers a turn's tool calls one at a time, in order: on a phone, resetting the APN
    then rebooting is not rebooting then resetting it."""
    plain = retail_line("0")
    tools = [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
        for name in ("reset_apn_settings", "reboot_device")
    ]
    line = replace(plain, user={**plain.user, "tools": tools, "guidelines_tools": "TOOLS"})
    model_server.script = scripted(
        agent=[Reply(text="Please reset your APN settings and reboot."), Reply(text="Great.")],
        user=[
            Reply(text="My phone has no data."),
            Reply(calls=(Call("reset_apn_settings", {}), Call("reboot_device", {}))),
            Reply(text="Done."),
            Reply(text=STOP),
        ],
    )
    phone = SlowPhone()

    result = await run_rollout(
        ChatPolicy(openai_client, AGENT), NoCalls(), line, user=simulated_user(openai_client, tools=phone)
    )

    assert result.ended_by == "user_stop"
    assert phone.events == [
        "start reset_apn_settings",
        "end reset_apn_settings",
        "start reboot_device",
        "end reboot_device",
    ]


@pytest.mark.parametrize(
    ("token", "ended_by"), [(TRANSFER, "user_transfer"), (OUT_OF_SCOPE, "user_out_of_scope")]
)
async def test_the_user_ends_the_episode_with_each_of_tau2s_tokens(
    token: str, ended_by: str, model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    model_server.script = scripted(
        agent=[Reply(text="I will transfer you.")], user=[Reply(text="Hello."), Reply(text=f"OK {token}")]
    )
    result = await run_rollout(
        ChatPolicy(openai_client, AGENT), NoCalls(), retail_line(), user=simulated_user(openai_client)
    )
    assert result.ended_by == ended_by
    assert result.sample is not None and result.sample["ended_by"] == ended_by  # for the grader
    assert len(by_model(model_server, AGENT)) == 1


async def test_the_conversation_stops_at_max_steps_counted_as_tau2_counts(
    model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    # The user's message (1), the agent's (2), the user's (3): τ² stops there with max_steps=3.
    model_server.script = scripted(
        agent=[Reply(text=f"Question {n}?") for n in range(5)],
        user=[Reply(text=f"Answer {n}.") for n in range(5)],
    )
    result = await run_rollout(
        ChatPolicy(openai_client, AGENT),
        NoCalls(),
        retail_line(),
        user=simulated_user(openai_client, max_steps=3),
    )
    assert result.ended_by == "max_steps"
    # The grader is told: τ² rewards a conversation cut short 0.
    assert result.sample is not None and result.sample["ended_by"] == "max_steps"
    assert len(by_model(model_server, USER)) == 2
    assert len(by_model(model_server, AGENT)) == 1


async def test_a_stop_on_the_last_step_is_max_steps_as_tau2_ends_it(
    model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    # τ²'s orchestrator checks the step limit after the step whose message holds the stop token, and
    # its MAX_STEPS replaces USER_STOP there: its evaluator rewards that conversation 0.
    model_server.script = scripted(
        agent=[Reply(text="Anything else?")], user=[Reply(text="Hello."), Reply(text=f"Thanks {STOP}")]
    )
    result = await run_rollout(
        ChatPolicy(openai_client, AGENT),
        NoCalls(),
        retail_line(),
        user=simulated_user(openai_client, max_steps=3),
    )
    assert result.ended_by == "max_steps"
    assert result.sample is not None and result.sample["ended_by"] == "max_steps"


async def test_a_line_without_a_scenario_plays_as_before(
    model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    line = retail_line()
    assert "user_simulator" not in line.item  # the tools never receive it
    plain = DatasetLine(messages=line.messages, tools=line.tools, item=line.item)
    model_server.script = scripted(agent=[Reply(text="Done.")], user=[])
    result = await run_rollout(
        ChatPolicy(openai_client, AGENT), NoCalls(), plain, user=simulated_user(openai_client)
    )
    assert result.ended_by == "answer"
    assert result.sample is not None and "ended_by" not in result.sample  # the platform's sample, as it was
    assert by_model(model_server, USER) == []


async def test_a_user_model_outage_discards_the_rollout_with_a_clear_reason(
    model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    model_server.script = scripted(agent=[], user=[])
    down = SimulatedUser(model=ChatPolicy(openai_client, "down"), name="down")
    result = await run_rollout(ChatPolicy(openai_client, AGENT), NoCalls(), retail_line(), user=down)
    assert result.ended_by == "discarded"
    assert result.discarded is not None and result.discarded.startswith("user_model_error: ")
    assert result.grade is None


async def test_http_user_tools_post_the_envelope_to_the_user_tools_route() -> None:
    seen: list[httpx.Request] = []

    def route(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"output": '{"airplane_mode": false}'})

    async with httpx.AsyncClient(transport=httpx.MockTransport(route)) as client:
        tools = HttpUserTools(
            as_transport(client), "http://sparring/", {"Authorization": "Bearer k"}, run="r"
        )
        call = FunctionCall(call_id="call_1", name="toggle_airplane_mode", arguments="{}")
        result = await tools.call(call, trace_id="trace_abc", item={"task_id": "7"})

    assert result.output == '{"airplane_mode": false}' and result.failure is None
    assert result.call == call  # answered under the conversation's id
    (request,) = seen
    assert str(request.url) == "http://sparring/user-tools/toggle_airplane_mode"
    assert request.headers["Authorization"] == "Bearer k"
    body = json.loads(request.content)
    assert (body["name"], body["call_id"], body["trace_id"], body["item"]) == (
        "toggle_airplane_mode",
        "user_call_1",  # the user's, as the server's own simulated user sends it: never an agent's id
        "trace_abc",
        {"task_id": "7"},
    )


async def test_the_agents_tool_calls_count_two_steps_toward_the_limit(
    model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    # The user's message (1), the agent's call and its results (2, 3): τ² stops there with max_steps=3.
    class Lookups:
        calls = 0

        async def call(self, call: FunctionCall, *, trace_id: str, item: Mapping[str, Any]) -> ToolResult:
            Lookups.calls += 1
            return ToolResult(call=call, output="{}")

    model_server.script = scripted(
        agent=[Reply(calls=(Call("find_user_id_by_email", {"email": "a@b.c"}),))] * 3,
        user=[Reply(text="Hello.")],
    )
    result = await run_rollout(
        ChatPolicy(openai_client, AGENT),
        Lookups(),
        retail_line(),
        user=simulated_user(openai_client, max_steps=3),
    )
    assert result.ended_by == "max_steps"
    assert Lookups.calls == 1
