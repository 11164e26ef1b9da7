"""Talking to sparring over HTTP as the training service does: tool URLs, the call envelope, retries, grading.

`ToolEndpoints` says where each tool's calls go and with which headers (one sparring server, or the
`tools` of a job config); `HttpToolCaller` and `HttpGrader` implement the loop's `ToolCaller` and
`Grader` with the platform's semantics:

- a 200 answer's `output` is what the model reads (an `Error: ...` output included);
- a 4xx (413 included) is shown to the model: the error body, serialized, as the platform does;
- a 5xx, a timeout or a network error is retried with the same `call_id` (`attempts` in all, 3 by
  default), then the call fails for good and the rollout is discarded;
- a grader answer other than 200 with a numeric `score` is retried the same way, then discarded; a
  413 (the request is too large) or a 422 (the grader cannot grade this item) is final: sending the
  same request again cannot change it.

Requests go through a `Transport`: `AiohttpTransport` (what the commands use: its client costs a
fraction of httpx's CPU per request, see `bench/runner.py`) or `HttpxTransport` (any
`httpx.AsyncClient`, e.g. one on an in-process ASGI app). The callers accept either a transport or a
plain `httpx.AsyncClient`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

import httpx

from app.rollouts.identity import RUN_HEADER
from app.runner.loop import FunctionCall, GradeResult, ToolResult

if TYPE_CHECKING:
    import aiohttp

DEFAULT_ATTEMPTS = 3
CALL_TIMEOUT_S = 600.0  # the platform's limit per tool call and per grade
FINAL_GRADE_STATUSES = frozenset({413, 422})  # answers the same request always gets


@dataclass(frozen=True)
class Endpoint:
    url: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolEndpoints:
    """Where each tool is served. `by_name` wins; other names go to `fallback` (None: not served)."""

    by_name: dict[str, Endpoint] = field(default_factory=dict)
    fallback: Endpoint | None = None

    @classmethod
    def for_server(cls, base_url: str, headers: Mapping[str, str]) -> ToolEndpoints:
        """Every tool of one sparring server: its own URL `<base>/tools/<name>`."""
        return cls(fallback=Endpoint(url=f"{base_url.rstrip('/')}/tools/{{name}}", headers=dict(headers)))

    @classmethod
    def from_job_config(cls, config: Mapping[str, Any], secrets: Mapping[str, str]) -> ToolEndpoints:
        """The `tools` of a job config (`sparring job-config`), with `<NAME>` placeholders in headers filled
        from `secrets`. A placeholder without a secret is an error: the call would only meet a 401."""
        entries = config.get("tools")
        if not isinstance(entries, list) or not entries:
            raise ValueError("the job config has no `tools` list")
        by_name: dict[str, Endpoint] = {}
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise ValueError("every job config tool needs a `name`")
            url = entry.get("server_url")
            if not isinstance(url, str) or not url:
                raise ValueError(f"tool {entry['name']!r} has no `server_url`")
            headers = fill_placeholders(entry.get("headers") or {}, secrets)
            by_name[entry["name"]] = Endpoint(url=url, headers=headers)
        return cls(by_name=by_name)

    def resolve(self, name: str) -> Endpoint | None:
        endpoint = self.by_name.get(name)
        if endpoint is not None:
            return endpoint
        if self.fallback is None:
            return None
        return Endpoint(
            url=self.fallback.url.replace("{name}", quote(name, safe="")), headers=self.fallback.headers
        )


def fill_placeholders(headers: Mapping[str, Any], secrets: Mapping[str, str]) -> dict[str, str]:
    """Replace every `<NAME>` in header values by `secrets[NAME]`; refuse a placeholder with no secret."""
    filled: dict[str, str] = {}
    for key, value in headers.items():
        text = str(value)
        for name, secret in secrets.items():
            text = text.replace(f"<{name}>", secret)
        if "<SPARRING_" in text:
            missing = text[text.index("<") + 1 : text.index(">")] if ">" in text else text
            raise ValueError(f"header {key!r} needs {missing}: set it in the environment")
        filled[str(key)] = text
    return filled


@dataclass(frozen=True)
class Answer:
    """An HTTP answer, read whole."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    reason: str = ""

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)


class TransportError(Exception):
    """The request got no HTTP answer: refused, reset, timed out."""


class Transport(Protocol):
    async def request(
        self, method: str, url: str, *, content: bytes | None, headers: Mapping[str, str], seconds: float
    ) -> Answer:
        """Send one request and read the whole answer within `seconds`; raise `TransportError` without one."""
        ...


class HttpxTransport:
    """Requests through an `httpx.AsyncClient` (its base URL, default headers and transport apply)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def request(
        self, method: str, url: str, *, content: bytes | None, headers: Mapping[str, str], seconds: float
    ) -> Answer:
        try:
            response = await self.client.request(
                method, url, content=content, headers=headers, timeout=seconds
            )
        except httpx.HTTPError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        return Answer(response.status_code, response.headers, response.content, response.reason_phrase)


class AiohttpTransport:
    """Requests through an `aiohttp.ClientSession`; open one with `AiohttpTransport.open(concurrency)`."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    @classmethod
    @asynccontextmanager
    async def open(cls, concurrency: int) -> AsyncIterator[AiohttpTransport]:
        """A session sized for `concurrency` rollouts in flight, each with a few parallel calls."""
        import aiohttp  # only where the runner's commands use it: `sparring.client` needs httpx alone

        connector = aiohttp.TCPConnector(limit=max(20, concurrency * 4), limit_per_host=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            yield cls(session)

    async def request(
        self, method: str, url: str, *, content: bytes | None, headers: Mapping[str, str], seconds: float
    ) -> Answer:
        import aiohttp

        try:
            async with self.session.request(
                method, url, data=content, headers=dict(headers), timeout=aiohttp.ClientTimeout(total=seconds)
            ) as response:
                body = await response.read()
                return Answer(response.status, dict(response.headers), body, response.reason or "")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc


def as_transport(client: Transport | httpx.AsyncClient) -> Transport:
    return HttpxTransport(client) if isinstance(client, httpx.AsyncClient) else client


@dataclass(frozen=True)
class Retry:
    """How failed attempts are repeated: `attempts` in all, waiting `delay_s`, doubled each time.

    A `Retry-After` header is honoured up to `max_delay_s`.
    """

    attempts: int = DEFAULT_ATTEMPTS
    delay_s: float = 0.5
    max_delay_s: float = 5.0

    def wait(self, attempt: int, answer: Answer | None) -> float:
        delay: float = self.delay_s * (2 ** (attempt - 1))
        if answer is not None:
            header = next((v for k, v in answer.headers.items() if k.lower() == "retry-after"), None)
            if header is not None:
                try:
                    delay = max(delay, float(header))
                except ValueError:
                    pass
        return min(delay, self.max_delay_s)


@dataclass(frozen=True)
class Attempt:
    """One try of a tool call: the output the model reads (done), or why it failed (tried again)."""

    status: int | None
    output: str | None = None
    failure: str = ""
    answer: Answer | None = None  # the failed answer, for its Retry-After


async def call_with_retries(
    call: FunctionCall, retry: Retry, attempt: Callable[[], Awaitable[Attempt]], *, started: float
) -> ToolResult:
    """The platform's rule for one tool call, whatever carries it: an answer (any status below 500)
    goes to the model; a 5xx or a network error is tried again with the same call, and after
    `retry.attempts` tries the call fails for good, which discards the rollout."""
    failure = "not sent"
    status: int | None = None
    for number in range(1, retry.attempts + 1):
        tried = await attempt()
        if tried.output is not None:
            return ToolResult(
                call=call,
                output=tried.output,
                status=tried.status,
                attempts=number,
                latency_s=time.perf_counter() - started,
            )
        failure, status = tried.failure, tried.status
        if number < retry.attempts:
            await asyncio.sleep(retry.wait(number, tried.answer))
    return ToolResult(
        call=call,
        output=None,
        status=status,
        attempts=retry.attempts,
        latency_s=time.perf_counter() - started,
        failure=f"{failure} after {retry.attempts} attempts",
    )


def _error_body(answer: Answer) -> str:
    """A 4xx shown to the model: the body as text, as the platform serializes it."""
    text = answer.text.strip()
    if not text:
        return f"Error: HTTP {answer.status} {answer.reason}".rstrip()
    return text


class HttpToolCaller:
    """Sends calls to sparring's tool routes with the platform's envelope, retries and discard rule."""

    def __init__(
        self,
        client: Transport | httpx.AsyncClient,
        endpoints: ToolEndpoints,
        *,
        run: str | None = None,
        retry: Retry | None = None,
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self.transport = as_transport(client)
        self.endpoints = endpoints
        self.run = run
        self.retry = retry or Retry()
        self.timeout_s = timeout_s

    async def call(self, call: FunctionCall, *, trace_id: str, item: Mapping[str, Any]) -> ToolResult:
        started = time.perf_counter()
        endpoint = self.endpoints.resolve(call.name)
        if endpoint is None:
            return ToolResult(
                call=call, output=f"Error: no tool named {call.name!r}", status=None, attempts=0
            )
        body = {
            "type": "function_call",
            "id": call.id or f"fc_{call.call_id}",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
            "trace_id": trace_id,
            "item": item,
        }
        headers = dict(endpoint.headers)
        if self.run:
            headers[RUN_HEADER] = self.run
        content = json.dumps(body, ensure_ascii=False).encode()
        headers["Content-Type"] = "application/json"

        async def attempt() -> Attempt:
            try:
                response = await self.transport.request(
                    "POST", endpoint.url, content=content, headers=headers, seconds=self.timeout_s
                )
            except TransportError as exc:
                return Attempt(status=None, failure=str(exc))
            if response.status < 500:
                return Attempt(status=response.status, output=_tool_output(response))
            return Attempt(status=response.status, failure=f"HTTP {response.status}", answer=response)

        return await call_with_retries(call, self.retry, attempt, started=started)


def _tool_output(response: Answer) -> str:
    if response.status != 200:
        return _error_body(response)
    try:
        data = response.json()
    except ValueError:
        return response.text
    if isinstance(data, dict) and "output" in data:
        output = data["output"]
        return output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
    return response.text


class HttpGrader:
    """Posts `{sample, item, trace_id}` to an endpoint grader and reads `{"score": float}`."""

    def __init__(
        self,
        client: Transport | httpx.AsyncClient,
        endpoint: Endpoint,
        *,
        run: str | None = None,
        retry: Retry | None = None,
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self.transport = as_transport(client)
        self.endpoint = endpoint
        self.run = run
        self.retry = retry or Retry()
        self.timeout_s = timeout_s

    async def grade(self, sample: Mapping[str, Any], item: Mapping[str, Any], trace_id: str) -> GradeResult:
        headers = dict(self.endpoint.headers)
        if self.run:
            headers[RUN_HEADER] = self.run
        headers["Content-Type"] = "application/json"
        content = json.dumps(
            {"sample": sample, "item": item, "trace_id": trace_id}, ensure_ascii=False
        ).encode()
        failure = "not sent"
        status: int | None = None
        for attempt in range(1, self.retry.attempts + 1):
            response: Answer | None = None
            try:
                response = await self.transport.request(
                    "POST", self.endpoint.url, content=content, headers=headers, seconds=self.timeout_s
                )
            except TransportError as exc:
                failure, status = str(exc), None
            else:
                status = response.status
                score = _score(response)
                if score is not None:
                    return GradeResult(score=score, status=status, attempts=attempt)
                failure = f"HTTP {status}: {response.text[:300]}"
                if status in FINAL_GRADE_STATUSES:
                    return GradeResult(score=None, failure=failure, status=status, attempts=attempt)
            if attempt < self.retry.attempts:
                await asyncio.sleep(self.retry.wait(attempt, response))
        return GradeResult(
            score=None,
            failure=f"{failure} (after {self.retry.attempts} attempts)",
            status=status,
            attempts=self.retry.attempts,
        )


def _score(response: Answer) -> float | None:
    if response.status != 200:
        return None
    try:
        data = response.json()
    except ValueError:
        return None
    score = data.get("score") if isinstance(data, dict) else None
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        return None
    return float(score)
