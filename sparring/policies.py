"""Model policies through the official `openai` SDK: the Responses API and Chat Completions.

Both turn the loop's provider-neutral `Transcript` into the API's request (the line's messages, its
tools, every earlier turn and tool output) and the API's answer into a `ModelTurn`. The request goes
through the SDK's generic `client.post` with the typed answer model (`Response`, `ChatCompletion`):
the typed `create` methods walk every request through the SDK's parameter transformer, which cost
tens of milliseconds of CPU per turn once a conversation holds a few tool calls (`bench/runner.py`). Any
OpenAI-compatible endpoint works (`base_url`); `ChatPolicy` is the one for vLLM, Ollama, llama.cpp
and most local servers, which do not speak the Responses API.

A model endpoint is not trusted to behave: `CappedAnswers` (the client's transport) stops an answer
past a byte cap while it streams in, `DeadlinePolicy` puts one deadline on each model turn (the
client's retries included), and whatever the endpoint answers, the policies raise `ModelFailure`
(with a `brief` free of the endpoint's words) rather than anything else.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx2
import openai
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from sparring.loop import FunctionCall, ModelFailure, ModelTurn, Policy, Transcript, Usage, function_of
from sparring.wire import new_call_id

Api = Literal["responses", "chat"]
APIS: tuple[Api, ...] = ("responses", "chat")

MODEL_ANSWER_MAX_BYTES = 4 * 1024 * 1024
"""The largest model answer read by default: far above any completion, far below what stalls a loop."""
MODEL_DEADLINE_S = 600.0
"""The default deadline of one model turn, the client's retries included."""


class RefusedExchange(httpx2.TransportError):
    """An exchange with a model endpoint that sparring itself stopped; the message is sparring's own
    words (never the endpoint's), so it may be shown to whoever sent the rollout."""


class AnswerTooLarge(RefusedExchange):
    """The model's answer passed the byte cap."""


class _CappedBody(httpx2.AsyncByteStream):
    """The body of an answer, decoded here (gzip, deflate) so the cap counts what will be parsed."""

    def __init__(self, inner: httpx2.AsyncByteStream, max_bytes: int, encoding: str) -> None:
        self.inner = inner
        self.max_bytes = max_bytes
        # wbits 47 reads gzip and zlib headers alike; a raw deflate stream needs -15.
        self.decoder = zlib.decompressobj(47) if encoding in ("gzip", "x-gzip", "deflate") else None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self.inner:
            if self.decoder is not None:
                # Never inflate more than the cap allows: a small compressed body may be a huge one.
                try:
                    chunk = self.decoder.decompress(chunk, self.max_bytes - seen + 1)
                except zlib.error as exc:
                    raise RefusedExchange("the model's compressed answer is corrupt") from exc
                if self.decoder.unconsumed_tail:
                    raise AnswerTooLarge(f"the model's answer is over {self.max_bytes} bytes")
            seen += len(chunk)
            if seen > self.max_bytes:
                raise AnswerTooLarge(f"the model's answer is over {self.max_bytes} bytes")
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


def _connect_failure(exc: httpx2.ConnectTimeout) -> httpx2.TransportError:
    """A connect "timeout" as what it was: the SDK's aiohttp transport files every aiohttp connection
    error (a refused connection, a closed socket) under `ConnectTimeout`, which the SDK then reports as
    `APITimeoutError: Request timed out`. Only a real timeout stays one."""
    cause = exc.__cause__
    from_aiohttp = cause is not None and type(cause).__module__.startswith("aiohttp")
    if cause is None or not from_aiohttp or isinstance(cause, TimeoutError):
        return exc  # a real timeout (aiohttp's are TimeoutErrors), or another transport's own words
    return httpx2.ConnectError(str(cause) or type(cause).__name__)


class CappedAnswers(httpx2.AsyncBaseTransport):
    """A transport that reads at most `max_bytes` of any answer, so no model answer can fill memory
    or hold the event loop parsing it; past the cap the request fails with `AnswerTooLarge`."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, max_bytes: int) -> None:
        self.inner = inner
        self.max_bytes = max_bytes

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        # Asked plain, so the cap is on the answer's real size; a gzip or deflate answer is decoded here.
        request.headers["Accept-Encoding"] = "identity"
        try:
            response = await self.inner.handle_async_request(request)
        except httpx2.ConnectTimeout as exc:
            raise _connect_failure(exc) from exc.__cause__
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        try:
            if encoding not in ("identity", "", "gzip", "x-gzip", "deflate"):
                raise RefusedExchange(f"the model answered in an encoding sparring does not read: {encoding}")
            length = response.headers.get("Content-Length", "")
            if encoding in ("identity", "") and length.isdigit() and int(length) > self.max_bytes:
                raise AnswerTooLarge(f"the model's answer is over {self.max_bytes} bytes")
        except RefusedExchange:
            await response.aclose()
            raise
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        headers = [
            (name, value)
            for name, value in response.headers.multi_items()
            if name.lower() not in ("content-encoding", "content-length")
        ]
        return httpx2.Response(
            status_code=response.status_code,
            headers=headers,
            stream=_CappedBody(response.stream, self.max_bytes, encoding),
            request=request,
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


def failure_of(exc: Exception) -> ModelFailure:
    """A failed model exchange as the loop's `ModelFailure`: the whole story as its message (for the
    operator), and a `brief` without anything the endpoint wrote (for whoever sent the rollout)."""
    detail = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__
    if cause is not None and str(cause) and str(cause) not in detail:
        detail = f"{detail} ({type(cause).__name__}: {cause})"  # the SDK's words alone hide the reason
    if isinstance(exc, openai.APIStatusError):
        brief = f"the model endpoint answered HTTP {exc.status_code}"
    elif isinstance(exc, openai.APITimeoutError):
        brief = "the model endpoint timed out"
    elif isinstance(exc, openai.APIConnectionError) and isinstance(cause, RefusedExchange):
        detail = brief = str(cause)
    elif isinstance(exc, openai.APIConnectionError):
        brief = "the model endpoint could not be reached"
    elif isinstance(exc, UnicodeEncodeError):
        # httpx refuses a header it cannot send: in practice the API key.
        detail = brief = "the model API key (or a header) is not ASCII, so it cannot be sent"
    else:
        brief = "the model endpoint answered something that is not a completion"
        detail = f"{brief} ({detail})"
    return ModelFailure(detail, brief=brief)


def _well_formed(text: str) -> str:
    """`text` with each lone surrogate as U+FFFD: JSON can escape one (`\\ud800`), but no UTF-8 encoder
    writes it back, so the grade request, the transcript and the database would all refuse the answer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= char <= "\udfff" else char for char in text)
    return text


def _well_formed_item(value: Any) -> Any:
    """An item of the answer kept as it came (a reasoning item), each of its strings `_well_formed`."""
    if isinstance(value, str):
        return _well_formed(value)
    if isinstance(value, dict):
        return {_well_formed_item(key): _well_formed_item(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_well_formed_item(item) for item in value]
    return value


def _text(value: object) -> str | None:
    """A text field of the answer, which the SDK did not check: text or absent, else malformed."""
    if value is None:
        return value
    if isinstance(value, str):
        return _well_formed(value)
    raise TypeError(f"expected text, got {type(value).__name__}")


def _name(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError("a function call without a name")
    return _well_formed(value)


def _tokens(value: object) -> int:
    """A token count of the answer's usage (0 when the endpoint reports something else)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _malformed(what: str) -> ModelFailure:
    message = f"the model endpoint answered something that is not a {what}"
    return ModelFailure(message, brief=message)


class DeadlinePolicy:
    """A policy whose every turn must come within `deadline_s`, however the endpoint trickles its
    answer and however often the client retries: a read timeout alone bounds only the gap between bytes."""

    def __init__(self, inner: Policy, deadline_s: float) -> None:
        self.inner = inner
        self.deadline_s = deadline_s

    async def next_turn(self, transcript: Transcript) -> ModelTurn:
        scope = asyncio.timeout(self.deadline_s)
        try:
            async with scope:
                return await self.inner.next_turn(transcript)
        except TimeoutError as exc:
            if not scope.expired():
                raise
            message = f"the model did not answer within {self.deadline_s:g} s"
            raise ModelFailure(message, brief=message) from exc


# What a policy writes into every request itself: sampling parameters may not replace them.
RESERVED_REQUEST_KEYS = frozenset({"model", "messages", "input", "tools", "stream"})


def sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """The sampling parameters sent with every request, refused (ValueError) where they would replace
    the model, the transcript or the tools the policy sends."""
    clashing = sorted(RESERVED_REQUEST_KEYS & params.keys())
    if clashing:
        raise ValueError(f"sampling parameters may not set {', '.join(clashing)}: the policy sends them")
    return params


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
        if step.reply is not None:
            items.append({"role": "user", "content": step.reply})
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
        # The results are those of the turn's first calls, in its order (a model may give two calls one
        # id); a call not sent (past the call budget) still needs an answer for the next request.
        outputs = [result.output or "" for result in step.results]
        for index, call in enumerate(turn.calls):
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.call_id,
                    "content": outputs[index] if index < len(outputs) else "Error: tool call limit reached",
                }
            )
        if step.reply is not None:
            messages.append({"role": "user", "content": step.reply})
    return messages


class ResponsesPolicy:
    """A model behind the Responses API (what Agent RFT uses)."""

    def __init__(self, client: AsyncOpenAI, model: str, /, **params: Any) -> None:
        self.client = client
        self.model = model
        self.params = sampling_params(params)

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
        except (openai.APIError, ValueError, TypeError) as exc:
            # ValueError: an answer that is not JSON, or an API key httpx cannot put in a header.
            raise failure_of(exc) from exc
        if not isinstance(response, Response):
            raise _malformed("response")
        try:
            return self._turn_of(response)
        except (AttributeError, TypeError, ValueError) as exc:
            # The SDK builds the answer without validating it: any shape can arrive here.
            raise _malformed("response") from exc

    def _turn_of(self, response: Response) -> ModelTurn:
        calls: list[FunctionCall] = []
        replay: list[dict[str, Any]] = []
        texts: list[str] = []
        for entry in response.output:
            if entry.type == "function_call":
                call = FunctionCall(
                    call_id=_text(entry.call_id) or new_call_id(),
                    name=_name(entry.name),
                    arguments=_text(entry.arguments) or "{}",
                    id=_text(entry.id),
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
                text = "".join(_text(part.text) or "" for part in entry.content if part.type == "output_text")
                texts.append(text)
                if text:
                    replay.append({"role": "assistant", "content": text})
            elif entry.type == "reasoning":
                # Reasoning models expect their reasoning items back next to the calls they led to.
                replay.append(_well_formed_item(entry.model_dump(exclude_none=True)))
        usage = Usage()
        if response.usage is not None:
            usage = Usage(_tokens(response.usage.input_tokens), _tokens(response.usage.output_tokens))
        return ModelTurn(text="".join(texts), calls=tuple(calls), usage=usage, replay=tuple(replay))


class ChatPolicy:
    """A model behind Chat Completions (vLLM, Ollama, llama.cpp and most local servers)."""

    def __init__(
        self, client: AsyncOpenAI, model: str, /, *, developer_role: str = "system", **params: Any
    ) -> None:
        self.client = client
        self.model = model
        self.developer_role = developer_role
        self.params = sampling_params(params)

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
        except (openai.APIError, ValueError, TypeError) as exc:
            # ValueError: an answer that is not JSON, or an API key httpx cannot put in a header.
            raise failure_of(exc) from exc
        if not isinstance(completion, ChatCompletion):
            raise _malformed("chat completion")
        if not completion.choices:
            raise ModelFailure("the completion has no choices")
        try:
            return self._turn_of(completion)
        except (AttributeError, TypeError, ValueError, LookupError) as exc:
            # The SDK builds the answer without validating it: any shape can arrive here.
            raise _malformed("chat completion") from exc

    def _turn_of(self, completion: ChatCompletion) -> ModelTurn:
        message = completion.choices[0].message
        calls = tuple(
            FunctionCall(
                call_id=_text(tool_call.id) or new_call_id(),
                name=_name(tool_call.function.name),
                arguments=_text(tool_call.function.arguments) or "{}",
            )
            for tool_call in message.tool_calls or []
            if tool_call.type == "function"
        )
        usage = Usage()
        if completion.usage is not None:
            usage = Usage(
                _tokens(completion.usage.prompt_tokens), _tokens(completion.usage.completion_tokens)
            )
        return ModelTurn(text=_text(message.content) or "", calls=calls, usage=usage)


def model_client(
    api_key: str, base_url: str | None, *, max_answer_bytes: int = MODEL_ANSWER_MAX_BYTES
) -> AsyncOpenAI:
    """The SDK client the commands use: its HTTP over aiohttp (the SDK's `DefaultAioHttpClient`), which
    costs a fraction of the CPU of its default httpx client when hundreds of rollouts are in flight,
    reading at most `max_answer_bytes` of any answer."""
    # aiohttp only where the commands run models.
    from openai import DEFAULT_CONNECTION_LIMITS, DefaultAioHttpClient
    from openai._vendor.httpx_aiohttp import AiohttpTransport

    transport = CappedAnswers(AiohttpTransport(limits=DEFAULT_CONNECTION_LIMITS), max_answer_bytes)
    return AsyncOpenAI(
        api_key=api_key, base_url=base_url, http_client=DefaultAioHttpClient(transport=transport)
    )


def make_policy(
    api: Api, client: AsyncOpenAI, model: str, *, deadline_s: float | None = None
) -> ResponsesPolicy | ChatPolicy | DeadlinePolicy:
    """The policy of `api` on `client`; with `deadline_s`, each turn must come within it."""
    policy: ResponsesPolicy | ChatPolicy = (
        ResponsesPolicy(client, model) if api == "responses" else ChatPolicy(client, model)
    )
    return policy if deadline_s is None else DeadlinePolicy(policy, deadline_s)


PREFLIGHT_PROMPT = "Reply with the single word: ok"
"""The one user message of the pre-flight turn (`check_model`): a few tokens, no tools."""


async def check_model(policy: Policy) -> ModelTurn:
    """One cheap turn of `policy` (no tools, a one-word answer) before a run spends anything: the
    turn, or the `ModelFailure` every rollout of the run would have met."""
    transcript = Transcript(
        trace_id="trace_preflight",
        messages=[{"role": "user", "content": PREFLIGHT_PROMPT}],
        tools=[],
        item={},
    )
    return await policy.next_turn(transcript)


def what_to_check(failure: ModelFailure, *, api: Api, base_url: str | None, key_env: str) -> str:
    """The settings to check for a failed model turn, by what failed: the address, the API, the key."""
    where = f"--base-url {base_url}" if base_url else "--base-url (unset: OpenAI's own API)"
    cause = failure.__cause__
    other: Api = "chat" if api == "responses" else "responses"
    if isinstance(cause, openai.APIStatusError):
        status = cause.status_code
        if status in (401, 403):
            return f"the model API key: set {key_env} to a key this endpoint accepts"
        if status in (404, 405):
            path = "/responses" if api == "responses" else "/chat/completions"
            return (
                f"--api {api}: the endpoint has no {path} (most local servers speak only chat: try --api "
                f"{other}); {where} (it usually ends in /v1); --model"
            )
        if status in (400, 422):
            return f"--model (a name this endpoint serves) and --api {api} (or try --api {other})"
        if status == 429:
            return f"the rate limit or quota of the key in {key_env}"
        return f"the model server at {where}: it fails with HTTP {status}"
    if isinstance(cause, openai.APITimeoutError) or isinstance(cause, TimeoutError):
        return f"{where}: the server is slow or does not answer (--model-timeout sets the wait)"
    if isinstance(cause, openai.APIConnectionError):
        return f"{where}: is a model server listening there?"
    return f"{where} and --api {api}: the answer is not an OpenAI-compatible one (or try --api {other})"
