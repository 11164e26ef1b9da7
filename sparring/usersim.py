"""The simulated user: an OpenAI-compatible model role-playing the customer of a τ²-bench task.

A dataset line whose item carries `user_simulator` is played as a conversation: the agent opens with
τ²'s greeting, the simulated user answers, and the two alternate as in τ²'s orchestrator. The line's
`user_simulator` holds what the simulator needs (written by `sparring dataset build`):

    {"scenario": {"persona": ..., "instructions": {...} or "..."},   # τ²'s user_scenario
     "guidelines": "...",          # τ²'s simulation guidelines
     "guidelines_tools": "...",    # optional: their variant for a user with tools (used when it has some)
     "tools": [...],               # optional: the user's own tools (chat-completions schemas)
     "agent_messages": [...]}      # optional: the agent's opening messages when a user plays

The user's system prompt is built as τ²'s `UserSimulator` builds it (the guidelines, then the scenario
in a `<scenario>` block, the scenario written as τ²'s `UserScenario.__str__` writes it); the model sees
the conversation role-flipped (the agent's texts as `user`, its own turns as `assistant`). Each user
turn is a message or tool calls: they run on the user's side (`UserTools`) one after another, in
order, as τ²'s orchestrator runs them; their results go back to the user and nothing of them is shown to
the agent. The user ends the episode with `###STOP###`,
`###TRANSFER###` or `###OUT-OF-SCOPE###`; the loop also stops at `max_steps`, counted as τ²'s
orchestrator counts them (every message and every batch of tool results is a step; a stop token on the
last step ends it as `max_steps`, as τ²'s does), and once the calls
of both sides have given `max_errors` errors (τ²'s `TOO_MANY_ERRORS`: every call answered `Error: ...`
counts, and the episode ends right after the batch of results that reaches the limit, before either
side reads it).

The user's turns are kept in `UserConversation.messages`, un-flipped, each with its role: `assistant`
for the agent's texts, `simulated_user` for the user's turns, `tool` for the results of its calls.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from sparring.http import Endpoint, HttpToolCaller, Retry, ToolEndpoints, Transport
from sparring.loop import (
    USER_KEY,
    FunctionCall,
    ModelFailure,
    Policy,
    ToolResult,
    Transcript,
    Usage,
    sent_as,
)
from sparring.wire import USER_CALL_PREFIX

SCENARIO_KEY = USER_KEY
"""The dataset line's key holding what the simulated user needs (left out of the tools' `item`)."""

GREETING = "Hi! How can I help you today?"
"""τ²'s first agent message: the agent opens every conversation with it."""

STOP = "###STOP###"
TRANSFER = "###TRANSFER###"
OUT_OF_SCOPE = "###OUT-OF-SCOPE###"

USER_ROLE = "simulated_user"
"""The role of the simulated user's turns in a stored conversation."""

DEFAULT_MODEL = "gpt-4.1"
DEFAULT_TEMPERATURE = 0.0
DEFAULT_MAX_STEPS = 200
DEFAULT_MAX_ERRORS = 10
"""τ²'s defaults: its user model, the user's temperature, the orchestrator's step and tool-error limits."""

UserEnd = Literal["user_stop", "user_transfer", "user_out_of_scope", "max_steps", "too_many_errors"]
_TOKENS: tuple[tuple[str, UserEnd], ...] = (
    (STOP, "user_stop"),
    (TRANSFER, "user_transfer"),
    (OUT_OF_SCOPE, "user_out_of_scope"),
)


class ScenarioError(ValueError):
    """A line's `user_simulator` is not what the simulator needs."""


def _indented(text: str) -> str:
    return textwrap.indent(text, "\t")


def instructions_text(instructions: Any) -> str:
    """A scenario's instructions as τ² writes them: a string as it is, structured ones field by field."""
    if isinstance(instructions, str):
        return instructions
    if not isinstance(instructions, Mapping):
        raise ScenarioError("the scenario's `instructions` must be text or an object")
    lines = [
        f"Domain: {instructions.get('domain')}",
        f"Reason for call:\n{_indented(str(instructions.get('reason_for_call')))}",
    ]
    for key, title in (("known_info", "Known info"), ("unknown_info", "Unknown info")):
        if instructions.get(key) is not None:
            lines.append(f"{title}:\n{_indented(str(instructions[key]))}")
    lines.append(f"Task instructions:\n{_indented(str(instructions.get('task_instructions')))}")
    return "\n".join(lines)


def scenario_text(scenario: Mapping[str, Any]) -> str:
    """A `user_scenario` as τ²'s `UserScenario.__str__` writes it: the persona, then the instructions."""
    lines = []
    if scenario.get("persona") is not None:
        lines += ["Persona:", _indented(str(scenario["persona"]))]
    lines += ["Instructions:", _indented(instructions_text(scenario.get("instructions")))]
    return "\n".join(lines)


def system_prompt(guidelines: str, scenario: Mapping[str, Any]) -> str:
    """The user's system prompt, as τ²'s `UserSimulator.system_prompt`."""
    return f"{guidelines}\n\n<scenario>\n{scenario_text(scenario)}\n</scenario>".strip()


def end_of(text: str) -> UserEnd | None:
    """Why a user message ends the episode (τ²'s stop tokens), or None."""
    return next((end for token, end in _TOKENS if token in text), None)


def user_scenario(spec: Any) -> Mapping[str, Any] | None:
    """A line's `user_simulator`, checked; None when the line has none."""
    if spec is None:
        return None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("scenario"), Mapping):
        raise ScenarioError(f"`{SCENARIO_KEY}` must be an object with a `scenario` object")
    if not isinstance(spec.get("guidelines"), str):
        raise ScenarioError(f"`{SCENARIO_KEY}.guidelines` must be the simulation guidelines' text")
    if spec.get("guidelines_tools") is not None and not isinstance(spec["guidelines_tools"], str):
        raise ScenarioError(
            f"`{SCENARIO_KEY}.guidelines_tools` must be the guidelines' text for a user with tools"
        )
    return spec


class UserTools(Protocol):
    """The user's own tools: their schemas for a scenario, and a call of one of them."""

    def schemas(self, scenario: Mapping[str, Any]) -> list[dict[str, Any]]: ...

    async def call(self, call: FunctionCall, *, trace_id: str, item: Mapping[str, Any]) -> ToolResult: ...


class NoUserTools:
    """A user without tools (retail, airline): no schemas, and any call answers an error it reads."""

    def schemas(self, scenario: Mapping[str, Any]) -> list[dict[str, Any]]:
        return []

    async def call(self, call: FunctionCall, *, trace_id: str, item: Mapping[str, Any]) -> ToolResult:
        return ToolResult(call=call, output=f"Error: the user has no tool {call.name!r}")


class HttpUserTools:
    """The user's tools on a sparring server, `POST <base>/user-tools/<name>` (the envelope, key and
    trace of `/tools/<name>`), with the schemas the line's `user_simulator.tools` lists."""

    def __init__(
        self,
        client: Transport,
        base_url: str,
        headers: Mapping[str, str],
        *,
        run: str | None = None,
        retry: Retry | None = None,
    ) -> None:
        endpoints = ToolEndpoints(
            fallback=Endpoint(url=f"{base_url.rstrip('/')}/user-tools/{{name}}", headers=dict(headers))
        )
        self.caller = HttpToolCaller(client, endpoints, run=run, retry=retry)

    def schemas(self, scenario: Mapping[str, Any]) -> list[dict[str, Any]]:
        return listed_tools(scenario)

    async def call(self, call: FunctionCall, *, trace_id: str, item: Mapping[str, Any]) -> ToolResult:
        """The call sent as the user's (`user_` and its id, as the server's own simulated user sends it:
        never one of the agent's ids); answered under the id the conversation holds."""
        sent = replace(call, call_id=USER_CALL_PREFIX + call.call_id)
        result = await self.caller.call(sent, trace_id=trace_id, item=item)
        return replace(result, call=call)


def listed_tools(scenario: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The user tools a line's `user_simulator` lists (chat-completions form)."""
    tools = scenario.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(tool, Mapping) for tool in tools):
        raise ScenarioError(f"`{SCENARIO_KEY}.tools` must be a list of function tools")
    return [dict(tool) for tool in tools]


def _tool_names(schemas: Sequence[Mapping[str, Any]]) -> set[str]:
    """The names of tools given in chat-completions form (`{"function": {"name"}}`) or flat (`{"name"}`)."""
    names = set()
    for schema in schemas:
        function = schema.get("function")
        name = function.get("name") if isinstance(function, Mapping) else schema.get("name")
        if isinstance(name, str):
            names.add(name)
    return names


def flipped(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The user's history as its model reads it (τ²'s `UserState.flip_roles`): the agent's texts as
    `user`, the user's own turns as `assistant`, the results of its calls as `tool`."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            out.append({"role": "user", "content": message.get("content")})
        elif role == USER_ROLE:
            turn: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                turn["tool_calls"] = message["tool_calls"]
            out.append(turn)
        elif role == "tool":
            call_id = message.get("tool_call_id")
            out.append({"role": "tool", "tool_call_id": call_id, "content": message.get("content")})
    return out


@dataclass
class UserReply:
    """What the user said to the agent (its tool calls ran before), and whether it ended the episode."""

    text: str
    ended: UserEnd | None = None


@dataclass
class UserConversation:
    """One rollout's simulated user: its prompt, its history, and the steps taken so far."""

    model: Policy
    tools: UserTools
    schemas: list[dict[str, Any]]
    prompt: str
    trace_id: str
    item: Mapping[str, Any]
    max_steps: int
    opening: list[dict[str, Any]] | None = None  # the agent's messages before the greeting, if given
    max_errors: int = DEFAULT_MAX_ERRORS
    messages: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0
    errors: int = 0  # the tool calls of both sides answered with an error
    usage: Usage = field(default_factory=Usage)

    def request(self) -> Transcript:
        """The next request to the user model: the system prompt and the flipped history."""
        messages = [{"role": "system", "content": self.prompt}, *flipped(self.messages)]
        return Transcript(trace_id=self.trace_id, messages=messages, tools=self.schemas, item={})

    async def open(
        self, line_messages: Sequence[Mapping[str, Any]]
    ) -> tuple[list[dict[str, Any]], UserReply]:
        """The agent's opening messages (its prompt, τ²'s greeting, the user's first message) and that
        first reply of the user."""
        reply = await self.reply(GREETING)
        # Without its own opening, the line's messages but its user messages (they speak for a
        # customer the simulator now plays).
        before = self.opening or [dict(m) for m in line_messages if m.get("role") != "user"]
        opening = [*before, {"role": "assistant", "content": GREETING}]
        if not reply.ended:
            opening.append({"role": "user", "content": reply.text})
        return opening, reply

    def count(self, steps: int = 1) -> None:
        """Steps the agent took (a message, a batch of tool results), counted with the user's own."""
        self.steps += steps

    @property
    def exhausted(self) -> bool:
        return self.steps >= self.max_steps

    def not_offered(self, name: str) -> str | None:
        """τ²'s error for a call of a tool the user was not given (a customer without tools: retail's,
        airline's; a name its tools do not have), else None. Such a call runs nothing: sent on, it
        would reach any enabled pack's user tool of that name (telecom's phone, for a retail customer)."""
        if not self.schemas:
            return "Error: User tools not available"
        if name in _tool_names(self.schemas):
            return None
        return f"Error: Tool '{name}' not found."

    def results_end(self, results: Sequence[ToolResult]) -> UserEnd | None:
        """Count a batch of tool results of either side (their errors, and the step) and say whether
        the episode ends after it: τ²'s error limit first, then its step limit."""
        self.errors += sum(1 for result in results if result.is_error)
        self.steps += 1
        if self.errors >= self.max_errors:
            return "too_many_errors"
        return "max_steps" if self.exhausted else None

    async def reply(self, agent_text: str) -> UserReply:
        """The user's answer to the agent's message: its tool calls run until it writes a message.

        Raises ModelFailure when the user model fails or answers nothing."""
        self.messages.append({"role": "assistant", "content": agent_text})
        return await self.resume()

    async def resume(self) -> UserReply:
        """The user's answer to the last message of its history (the agent's, or the results of its
        own calls): what `reply` does once it has added the agent's message. A `reply` that failed
        after some of the user's calls ran continues here from `messages` as it left them: a last turn
        of calls without results (some may have run before the failure) runs its calls again under
        their ids first, so the ones that ran replay their answers rather than apply twice."""
        calls = pending_calls(self.messages)
        while True:
            if not calls:
                turn = await self.model.next_turn(self.request())
                self.usage.add(turn.usage)
                self.steps += 1
                if not turn.calls:
                    if not turn.text.strip():
                        raise ModelFailure("the user model answered an empty message")
                    self.messages.append({"role": USER_ROLE, "content": turn.text})
                    # τ² checks its step limit after the message's step: MAX_STEPS replaces a stop there.
                    ended = "max_steps" if self.exhausted else end_of(turn.text)
                    return UserReply(text=turn.text, ended=ended)
                # An id the user's calls used already (a model server numbering each answer's calls
                # from 0) is held under another: each call of the rollout runs once, and a resumed
                # turn (above) runs its calls again under the same ids.
                calls = sent_as(turn.calls, _ids_of(self.messages))
                self.messages.append(
                    {"role": USER_ROLE, "content": turn.text or None, "tool_calls": _chat_calls(calls)}
                )
            # One after another, in order, as τ²'s orchestrator answers them (a phone's result depends on
            # the order: reset the APN settings, then reboot); a failure leaves the rest for the retry.
            results = []
            for call in calls:
                refused = self.not_offered(call.name)
                if refused is not None:  # τ²'s own answer: nothing runs, and it counts as an error
                    results.append(ToolResult(call=call, output=refused))
                    continue
                result = await self.tools.call(call, trace_id=self.trace_id, item=self.item)
                if result.failure is not None:
                    raise ModelFailure(f"the user's tool {call.name} failed: {result.failure}")
                results.append(result)
            calls = []
            for result in results:
                self.messages.append(
                    {"role": "tool", "tool_call_id": result.call.call_id, "content": result.output or ""}
                )
            ended = self.results_end(results)
            if ended is not None:
                return UserReply(text="", ended=ended)


def settled(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A user's history up to its last complete point: without a last turn of tool calls whose results
    never came (its calls failed), which a model would refuse to read."""
    kept = [dict(message) for message in messages]
    if kept and kept[-1].get("role") == USER_ROLE and kept[-1].get("tool_calls"):
        kept.pop()
    return kept


def _ids_of(messages: Sequence[Mapping[str, Any]]) -> set[str]:
    """The ids of the user's calls in `messages` (its own turns)."""
    return {
        str(call.get("id"))
        for message in messages
        if message.get("role") == USER_ROLE
        for call in message.get("tool_calls") or ()
    }


def pending_calls(messages: Sequence[Mapping[str, Any]]) -> list[FunctionCall]:
    """The calls of a last turn of the user whose results never came (its calls failed), else none."""
    last = messages[-1] if messages else {}
    if last.get("role") != USER_ROLE or not last.get("tool_calls"):
        return []
    return [
        FunctionCall(call_id=call["id"], name=function["name"], arguments=function["arguments"])
        for call in last["tool_calls"]
        for function in (call["function"],)
    ]


def _chat_calls(calls: Sequence[FunctionCall]) -> list[dict[str, Any]]:
    return [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in calls
    ]


@dataclass(frozen=True)
class SimulatedUser:
    """The simulated user of a run: its model (a chat `Policy`, e.g. `sparring.policies.ChatPolicy`
    with τ²'s temperature), its tools, and the step limit. `name` is the model's, for the report."""

    model: Policy
    name: str
    tools: UserTools = field(default_factory=NoUserTools)
    max_steps: int = DEFAULT_MAX_STEPS
    max_errors: int = DEFAULT_MAX_ERRORS

    def start(self, scenario: Any, item: Mapping[str, Any], trace_id: str) -> UserConversation | None:
        """The user of one rollout of a line: `scenario` is its `user_simulator` (None: the line has no
        user, and None is returned), `item` what the user's tools receive. ScenarioError when the
        scenario is not usable."""
        spec = user_scenario(scenario)
        if spec is None:
            return None
        schemas = self.tools.schemas(spec)
        guidelines = spec.get("guidelines_tools") if schemas else None
        return UserConversation(
            model=self.model,
            tools=self.tools,
            schemas=schemas,
            prompt=system_prompt(guidelines or spec["guidelines"], spec["scenario"]),
            trace_id=trace_id,
            item=item,
            max_steps=self.max_steps,
            opening=agent_opening(spec),
            max_errors=self.max_errors,
        )


def agent_opening(spec: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The agent's messages before the greeting given by a line's `user_simulator.agent_messages`."""
    opening = spec.get("agent_messages")
    if not isinstance(opening, list) or not opening:
        return None
    if not all(isinstance(message, Mapping) for message in opening):
        raise ScenarioError(f"`{SCENARIO_KEY}.agent_messages` must be a list of messages")
    return [dict(message) for message in opening]
