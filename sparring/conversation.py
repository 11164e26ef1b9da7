"""A rollout's conversation: the one stored shape of what the model read and wrote, turn by turn.

When sparring runs the loop (`sparring eval`, `sparring canary`, remote rollouts, `run_episode`) it
knows every model turn; the call log only sees the tool calls. The conversation is kept beside the
rollout (`PUT /rollouts/{trace_id}/transcript`, which a trainer running its own loop may call too) and
shown on the review's rollout page, interleaved with the logged calls by `call_id`.

The shape (JSON):

    {"model": "gpt-5-mini" | null, "source": "eval" | "canary" | ... | null,
     "messages": [
        {"role": "system" | "user" | "simulated_user", "content": "..."},
        {"role": "assistant", "content": "...", "reasoning": "summary" | null,
         "tool_calls": [{"call_id": "call_1", "name": "get_order", "arguments": "{...}"}]},
        {"role": "tool", "call_id": "call_1", "content": "the output the model read"}]}

`simulated_user` is a customer played by a model (a user simulator), `user` a dataset's own turn.
`developer` messages are stored as `system`. `parse_conversation` checks a conversation from outside
(ValueError naming the bad field); `conversation_of` builds one from a finished rollout.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from sparring.http import Endpoint, Transport, TransportError, as_transport
from sparring.loop import ModelTurn, RolloutResult, ToolResult, content_text
from sparring.wire import call_key

log = logging.getLogger(__name__)

ROLES = ("system", "user", "simulated_user", "assistant", "tool")
MAX_MESSAGES = 5_000
MAX_NAME_CHARS = 200
UNSENT_OUTPUT = "Error: tool call limit reached"  # what the model read for a call past the budget
# Answers that will not change within a run (a key without the scope, a server without the route).
REFUSALS = frozenset({401, 403, 404, 405})


def _text_field(message: Mapping[str, Any], name: str, where: str, *, required: bool = False) -> str | None:
    value = message.get(name)
    if value is None:
        if required:
            raise ValueError(f"{where}.{name} is required")
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where}.{name} must be a string")
    return value


def _name(value: str | None, where: str) -> str:
    if not value or len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{where} must be 1 to {MAX_NAME_CHARS} characters")
    return value


def _tool_calls(raw: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(raw, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    calls = []
    for index, call in enumerate(raw):
        at = f"{where}.tool_calls[{index}]"
        if not isinstance(call, Mapping):
            raise ValueError(f"{at} must be an object")
        calls.append(
            {
                "call_id": _name(_text_field(call, "call_id", at, required=True), f"{at}.call_id"),
                "name": _name(_text_field(call, "name", at, required=True), f"{at}.name"),
                "arguments": _text_field(call, "arguments", at) or "",
            }
        )
    return calls


def parse_message(message: Any, where: str) -> dict[str, Any]:
    """One message of the stored shape, checked and normalised (unknown fields dropped)."""
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object")
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role not in ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}")
    content = message.get("content")
    parsed: dict[str, Any] = {
        "role": role,
        "content": content if isinstance(content, str) else content_text(content),
    }
    if role == "assistant":
        parsed["reasoning"] = _text_field(message, "reasoning", where)
        parsed["tool_calls"] = _tool_calls(message.get("tool_calls") or [], where)
    if role == "tool":
        parsed["call_id"] = _name(_text_field(message, "call_id", where, required=True), f"{where}.call_id")
    return parsed


def parse_conversation(data: Any) -> dict[str, Any]:
    """A conversation from outside, checked: ValueError with the field at fault, else the stored shape."""
    if not isinstance(data, Mapping):
        raise ValueError("the transcript must be a JSON object with `messages`")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("`messages` must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"at most {MAX_MESSAGES} messages")
    model = _text_field(data, "model", "transcript")
    source = _text_field(data, "source", "transcript")
    return {
        "model": _name(model, "transcript.model") if model is not None else None,
        "source": _name(source, "transcript.source") if source is not None else None,
        "messages": [parse_message(message, f"messages[{index}]") for index, message in enumerate(messages)],
    }


def reasoning_summary(turn: ModelTurn) -> str | None:
    """The reasoning summary a turn came with (the Responses API's reasoning items), if any."""
    parts = []
    for entry in turn.replay:
        if entry.get("type") != "reasoning":
            continue
        for part in entry.get("summary") or ():
            text = part.get("text") if isinstance(part, Mapping) else None
            if isinstance(text, str) and text:
                parts.append(text)
    return "\n\n".join(parts) or None


def conversation_of(
    result: RolloutResult, *, model: str | None = None, source: str | None = None
) -> dict[str, Any]:
    """The conversation of a finished rollout: the line's messages, then each turn and its calls' outputs."""
    transcript = result.transcript
    messages = [
        parse_message(message, f"messages[{index}]")
        for index, message in enumerate(transcript.messages)
        if isinstance(message, Mapping) and message.get("role") in (*ROLES, "developer")
    ]
    # With a simulated user, the opening's user turn is the simulator's (the line's own were dropped).
    played = transcript.user is not None
    if played:
        messages = [{**m, "role": "simulated_user"} if m["role"] == "user" else m for m in messages]
    for step in transcript.steps:
        turn = step.turn
        # Each call named by the id the server logged it under (a model may use one id twice in a
        # rollout, which the loop sends under another; the log fits a long one to its column), so the
        # review finds its logged call.
        ids = [call_key(call_id) or call_id for call_id in step.sent] + [
            call_key(call.call_id) or call.call_id for call in turn.calls[len(step.sent) :]
        ]
        messages.append(
            {
                "role": "assistant",
                "content": turn.text,
                "reasoning": reasoning_summary(turn),
                "tool_calls": [
                    {"call_id": call_id, "name": call.name[:MAX_NAME_CHARS], "arguments": call.arguments}
                    for call_id, call in zip(ids, turn.calls, strict=True)
                ],
            }
        )
        if step.sent:  # the results are those of the turn's first calls, in its order
            outputs = [_output(r) for r in step.results]
        else:
            answered = {r.call.call_id: _output(r) for r in step.results}
            outputs = [answered.get(call.call_id, UNSENT_OUTPUT) for call in turn.calls]
        for index, call_id in enumerate(ids):
            output = outputs[index] if index < len(outputs) else UNSENT_OUTPUT
            messages.append({"role": "tool", "call_id": call_id, "content": output})
        if played and step.reply is not None:
            messages.append({"role": "simulated_user", "content": step.reply})
    return {"model": model, "source": source, "messages": messages}


def _output(result: ToolResult) -> str:
    return result.output if result.output is not None else f"Error: {result.failure}"


class TranscriptStore(Protocol):
    """Keeps a finished rollout's conversation; never raises (a rollout is not lost for its transcript)."""

    async def store(self, result: RolloutResult, model: str | None = None) -> None: ...


class HttpTranscripts:
    """PUTs conversations to a sparring server (`{server}/rollouts/{trace_id}/transcript`, a grader or
    admin key). Best effort: a refusal or an outage is logged, the run goes on."""

    def __init__(
        self,
        client: Transport | httpx.AsyncClient,
        server: Endpoint,
        *,
        model: str | None = None,
        source: str | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.transport: Transport = as_transport(client)
        self.server = server
        self.model = model
        self.source = source
        self.timeout_s = timeout_s
        self.failures = 0
        self.refused = False  # the server refused the route or the key: not asked again this run

    async def store(self, result: RolloutResult, model: str | None = None) -> None:
        if self.refused:
            return
        conversation = conversation_of(result, model=model or self.model, source=self.source)
        # Escaped whole: a trainer's own trace id may hold "/", "?", "#" or "%".
        url = f"{self.server.url.rstrip('/')}/rollouts/{quote(result.trace_id, safe='')}/transcript"
        headers = {**self.server.headers, "Content-Type": "application/json"}
        content = json.dumps(conversation, ensure_ascii=False).encode()
        try:
            answer = await self.transport.request(
                "PUT", url, content=content, headers=headers, seconds=self.timeout_s
            )
        except TransportError as exc:
            self._failed(result.trace_id, str(exc))
            return
        if answer.status in REFUSALS:
            self.refused = True
            log.warning(
                "%s refused to keep conversations (HTTP %s): none is stored this run",
                self.server.url,
                answer.status,
            )
        elif answer.status >= 300:
            self._failed(result.trace_id, f"HTTP {answer.status}: {answer.text[:200]}")

    def _failed(self, trace_id: str, why: str) -> None:
        self.failures += 1
        log.warning("the transcript of %s was not stored: %s", trace_id, why)
