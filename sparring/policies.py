"""Model policies through the official `openai` SDK: the Responses API and Chat Completions.

Both turn the loop's provider-neutral `Transcript` into the API's request (the line's messages, its
tools, every earlier turn and tool output) and the API's answer into a `ModelTurn`. The request goes
through the SDK's generic `client.post` with the typed answer model (`Response`, `ChatCompletion`):
the typed `create` methods walk every request through the SDK's parameter transformer, which cost
tens of milliseconds of CPU per turn once a conversation holds a few tool calls (`bench/runner.py`). Any
OpenAI-compatible endpoint works (`base_url`); `ChatPolicy` is the one for vLLM, Ollama, llama.cpp
and most local servers, which do not speak the Responses API.
"""

from __future__ import annotations

from typing import Any, Literal

import openai
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from sparring.loop import FunctionCall, ModelFailure, ModelTurn, Transcript, Usage, function_of
from sparring.wire import new_call_id

Api = Literal["responses", "chat"]
APIS: tuple[Api, ...] = ("responses", "chat")


def responses_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Dataset tools (chat-completions form) as Responses API function tools."""
    converted = []
    for tool in tools:
        fn = function_of(tool)
        entry: dict[str, Any] = {
            "type": "function",
            "name": fn.get("name"),
            "parameters": fn.get("parameters") or {"type": "object", "properties": {}},
            "strict": bool(fn.get("strict", False)),
        }
        if fn.get("description"):
            entry["description"] = fn["description"]
        converted.append(entry)
    return converted


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Dataset tools in the chat-completions form (flat function tools are wrapped)."""
    return [{"type": "function", "function": dict(function_of(tool))} for tool in tools]


def responses_input(transcript: Transcript) -> list[dict[str, Any]]:
    """The whole conversation as Responses API input items."""
    items: list[dict[str, Any]] = [dict(message) for message in transcript.messages]
    for step in transcript.steps:
        turn = step.turn
        if turn.replay:
            items.extend(dict(entry) for entry in turn.replay)
        else:
            if turn.text:
                items.append({"role": "assistant", "content": turn.text})
            items.extend(
                {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                for c in turn.calls
            )
        for result in step.results:
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": result.call.call_id,
                    "output": result.output or "",
                }
            )
    return items


def chat_messages(transcript: Transcript, *, developer_role: str = "system") -> list[dict[str, Any]]:
    """The whole conversation as chat messages. `developer` messages become `developer_role`, since most
    local servers only know `system`."""
    messages: list[dict[str, Any]] = []
    for message in transcript.messages:
        converted = dict(message)
        if converted.get("role") == "developer":
            converted["role"] = developer_role
        messages.append(converted)
    for step in transcript.steps:
        turn = step.turn
        assistant: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
        if turn.calls:
            assistant["tool_calls"] = [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in turn.calls
            ]
        messages.append(assistant)
        # A call not sent (past the call budget) still needs an answer for the next request to be valid.
        answered = {result.call.call_id: result.output or "" for result in step.results}
        for call in turn.calls:
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.call_id,
                    "content": answered.get(call.call_id, "Error: tool call limit reached"),
                }
            )
    return messages


class ResponsesPolicy:
    """A model behind the Responses API (what Agent RFT uses)."""

    def __init__(self, client: AsyncOpenAI, model: str, **params: Any) -> None:
        self.client = client
        self.model = model
        self.params = params

    async def next_turn(self, transcript: Transcript) -> ModelTurn:
        request: dict[str, Any] = {
            "model": self.model,
            "input": responses_input(transcript),
            **self.params,
        }
        if transcript.tools:
            request["tools"] = responses_tools(transcript.tools)
            request.setdefault("parallel_tool_calls", True)
        try:
            response = await self.client.post("/responses", cast_to=Response, body=request)
        except openai.APIError as exc:
            raise ModelFailure(f"{type(exc).__name__}: {exc}") from exc
        calls: list[FunctionCall] = []
        replay: list[dict[str, Any]] = []
        texts: list[str] = []
        for entry in response.output:
            if entry.type == "function_call":
                call = FunctionCall(
                    call_id=entry.call_id or new_call_id(),
                    name=entry.name,
                    arguments=entry.arguments or "{}",
                    id=entry.id,
                )
                calls.append(call)
                replay.append(
                    {
                        "type": "function_call",
                        "call_id": call.call_id,
                        "name": call.name,
                        "arguments": call.arguments,
                    }
                )
            elif entry.type == "message":
                text = "".join(part.text for part in entry.content if part.type == "output_text")
                texts.append(text)
                if text:
                    replay.append({"role": "assistant", "content": text})
            elif entry.type == "reasoning":
                # Reasoning models expect their reasoning items back next to the calls they led to.
                replay.append(entry.model_dump(exclude_none=True))
        usage = Usage()
        if response.usage is not None:
            usage = Usage(response.usage.input_tokens, response.usage.output_tokens)
        return ModelTurn(text="".join(texts), calls=tuple(calls), usage=usage, replay=tuple(replay))


class ChatPolicy:
    """A model behind Chat Completions (vLLM, Ollama, llama.cpp and most local servers)."""

    def __init__(
        self, client: AsyncOpenAI, model: str, *, developer_role: str = "system", **params: Any
    ) -> None:
        self.client = client
        self.model = model
        self.developer_role = developer_role
        self.params = params

    async def next_turn(self, transcript: Transcript) -> ModelTurn:
        request: dict[str, Any] = {
            "model": self.model,
            "messages": chat_messages(transcript, developer_role=self.developer_role),
            **self.params,
        }
        if transcript.tools:
            request["tools"] = chat_tools(transcript.tools)
        try:
            completion = await self.client.post("/chat/completions", cast_to=ChatCompletion, body=request)
        except openai.APIError as exc:
            raise ModelFailure(f"{type(exc).__name__}: {exc}") from exc
        if not completion.choices:
            raise ModelFailure("the completion has no choices")
        message = completion.choices[0].message
        calls = tuple(
            FunctionCall(
                call_id=tool_call.id or new_call_id(),
                name=tool_call.function.name,
                arguments=tool_call.function.arguments or "{}",
            )
            for tool_call in message.tool_calls or []
            if tool_call.type == "function"
        )
        usage = Usage()
        if completion.usage is not None:
            usage = Usage(completion.usage.prompt_tokens, completion.usage.completion_tokens)
        return ModelTurn(text=message.content or "", calls=calls, usage=usage)


def model_client(api_key: str, base_url: str | None) -> AsyncOpenAI:
    """The SDK client the commands use: its HTTP over aiohttp (the SDK's `DefaultAioHttpClient`), which
    costs a fraction of the CPU of its default httpx client when hundreds of rollouts are in flight."""
    from openai import DefaultAioHttpClient  # aiohttp only where the commands run models

    return AsyncOpenAI(api_key=api_key, base_url=base_url, http_client=DefaultAioHttpClient())


def make_policy(api: Api, client: AsyncOpenAI, model: str) -> ResponsesPolicy | ChatPolicy:
    if api == "responses":
        return ResponsesPolicy(client, model)
    return ChatPolicy(client, model)
