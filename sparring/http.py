"""Talking to sparring over HTTP as the training service does: tool URLs, the call envelope, retries, grading.

`ToolEndpoints` says where each tool's calls go and with which headers (one sparring server, or the
`tools` of a job config); `HttpToolCaller` and `HttpGrader` implement the loop's `ToolCaller` and
`GradeCaller` with the platform's semantics:

- a 200 answer's `output` is what the model reads (an `Error: ...` output included);
- a 4xx (413 included) is shown to the model: the error body, serialized, as the platform does;
- a grade is done when a 200 answer holds a numeric `score`; a 4xx to a grade is `refused` (a key, a
  grader name or a body to fix) and not tried again, but for a 408 or 429 ("not now");
- otherwise (a 5xx, a timeout, a network error, a grade answer without a score, a 408 or 429 to a
  grade) the call or grade is tried again with the same `call_id` (`attempts` in all, 3 by default),
  then it failed for good and the rollout is discarded.

That rule is `with_retries`, the one rule of tool calls and grades, whatever carries them: the
server's in-process callers (`app.remote.runner`) use it too, naming their failures with the same
`FailureKind`s instead of HTTP statuses.

Requests go through a `Transport`: `AiohttpTransport` (what the commands use: its client costs a
fraction of httpx's CPU per request, see `bench/runner.py`) or `HttpxTransport` (any
`httpx.AsyncClient`, e.g. one on an in-process ASGI app). The callers accept either a transport or a
plain `httpx.AsyncClient`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar
from urllib.parse import quote

import httpx

from sparring.loop import FunctionCall, GradeOutcome, ToolResult
from sparring.tracing import inject_context
from sparring.wire import INFRA_ERROR, REFUSED, RUN_HEADER, FailureKind, failure_kind_of_status

if TYPE_CHECKING:
    import aiohttp

T = TypeVar("T")

DEFAULT_ATTEMPTS = 3
CALL_TIMEOUT_S = 600.0  # the platform's limit per tool call and per grade


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
    def for_server(cls, base_url: str, headers: Mapping[str, str], pack: str | None = None) -> ToolEndpoints:
        """Every tool of one sparring server: its own URL `<base>/tools/<name>`; with `pack`, every tool of
        that pack at its pack's route `<base>/packs/<pack>/tools/<name>` (the names it shares included)."""
        prefix = f"/packs/{quote(pack, safe='')}" if pack is not None else ""
        return cls(
            fallback=Endpoint(url=f"{base_url.rstrip('/')}{prefix}/tools/{{name}}", headers=dict(headers))
        )

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
            headers = fill_placeholders(headers_of(entry, f"tool {entry['name']!r}"), secrets)
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


def headers_of(entry: Mapping[str, Any], what: str) -> Mapping[str, Any]:
    """The `headers` of a job config's tool or grader entry ({} without them); ValueError unless an object."""
    headers = entry.get("headers") or {}
    if not isinstance(headers, Mapping):
        raise ValueError(f"{what}: `headers` must be an object of header names and values")
    return headers


def fill_placeholders(headers: Mapping[str, Any], secrets: Mapping[str, str]) -> dict[str, str]:
    """Replace every `<NAME>` in header values by `secrets[NAME]`; refuse a placeholder with no secret."""
    filled: dict[str, str] = {}
    for key, value in headers.items():
        text = str(value)
        for name, secret in secrets.items():
            text = text.replace(f"<{name}>", secret)
        if "<SPARRING_" in text:
            start = text.index("<SPARRING_") + 1
            end = text.find(">", start)
            missing = text[start:end] if end >= 0 else text[start:]
            raise ValueError(f"header {key!r} needs {missing}: set it in the environment")
        filled[str(key)] = text
    return filled


@dataclass(frozen=True)
class HttpAnswer:
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
    ) -> HttpAnswer:
        """Send one request and read the whole answer within `seconds`; raise `TransportError` without one."""
        ...


class HttpxTransport:
    """Requests through an `httpx.AsyncClient` (its base URL, default headers and transport apply)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def request(
        self, method: str, url: str, *, content: bytes | None, headers: Mapping[str, str], seconds: float
    ) -> HttpAnswer:
        # httpx's timeout bounds each wait (to connect, for the next bytes), not the whole exchange: an
        # answer trickling in would hold the call for ever. The deadline is the whole request's.
        scope = asyncio.timeout(seconds)
        try:
            async with scope:
                response = await self.client.request(
                    method, url, content=content, headers=headers, timeout=seconds
                )
        except httpx.HTTPError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        except TimeoutError as exc:
            if not scope.expired():
                raise
            raise TransportError(f"no whole answer within {seconds:g} s") from exc
        return HttpAnswer(response.status_code, response.headers, response.content, response.reason_phrase)


class AiohttpTransport:
    """Requests through an `aiohttp.ClientSession`; open one with `AiohttpTransport.open(concurrency)`."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    @classmethod
    @asynccontextmanager
    async def open(cls, concurrency: int) -> AsyncIterator[AiohttpTransport]:
        """A session sized for `concurrency` rollouts in flight, each with a few parallel calls."""
        import aiohttp  # only where a transport is opened: most of the client never needs it

        connector = aiohttp.TCPConnector(limit=max(20, concurrency * 4), limit_per_host=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            yield cls(session)

    async def request(
        self, method: str, url: str, *, content: bytes | None, headers: Mapping[str, str], seconds: float
    ) -> HttpAnswer:
        import aiohttp

        try:
            async with self.session.request(
                method, url, data=content, headers=dict(headers), timeout=aiohttp.ClientTimeout(total=seconds)
            ) as response:
                body = await response.read()
                return HttpAnswer(response.status, dict(response.headers), body, response.reason or "")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc


def as_transport(client: Transport | httpx.AsyncClient) -> Transport:
    return HttpxTransport(client) if isinstance(client, httpx.AsyncClient) else client


@dataclass(frozen=True)
class Retry:
    """How failed attempts are repeated: `attempts` in all, waiting `delay_s`, doubled each time.

    A `Retry-After` the failed answer carried is honoured up to `max_delay_s`.
    """

    attempts: int = DEFAULT_ATTEMPTS
    delay_s: float = 0.5
    max_delay_s: float = 5.0

    def wait(self, attempt: int, retry_after_s: float | None = None) -> float:
        delay: float = self.delay_s * (2 ** (attempt - 1))
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        return min(delay, self.max_delay_s)


def retry_after(answer: HttpAnswer) -> float | None:
    """The seconds an answer's `Retry-After` header asks for; None without one (or an HTTP date)."""
    header = next((v for k, v in answer.headers.items() if k.lower() == "retry-after"), None)
    if header is None:
        return None
    try:
        return float(header)
    except ValueError:
        return None


@dataclass(frozen=True)
class Attempt(Generic[T]):
    """One try of a tool call or a grade: the value (done), or the failure, its kind and its wait."""

    value: T | None = None
    failure: str = ""
    kind: FailureKind | None = None
    status: int | None = None  # the HTTP status, when the try went over HTTP and got an answer
    retry_after_s: float | None = None

    @classmethod
    def failed_answer(cls, answer: HttpAnswer, failure: str) -> Attempt[T]:
        """A failed HTTP answer: its kind from the status, its Retry-After kept for the wait."""
        return cls(
            failure=failure,
            kind=failure_kind_of_status(answer.status),
            status=answer.status,
            retry_after_s=retry_after(answer),
        )


@dataclass(frozen=True)
class Tried(Generic[T]):
    """The last attempt of a call or grade, and how many were made."""

    last: Attempt[T]
    attempts: int

    @property
    def failure(self) -> str:
        return f"{self.last.failure} after {self.attempts} attempt{'s' if self.attempts > 1 else ''}"


async def with_retries(retry: Retry, attempt: Callable[[], Awaitable[Attempt[T]]]) -> Tried[T]:
    """The platform's rule for one tool call or grade, whatever carries it (HTTP or in-process).

    An attempt with a value is done. A `refused` one is final: another try meets the same answer. Any
    other failure (`tool_crash`, `infra_error`) is tried again, the same request each time, and after
    `retry.attempts` tries the call or grade failed for good, which discards the rollout.
    """
    number = 0
    while True:
        number += 1
        tried = await attempt()
        if tried.value is not None or tried.kind == REFUSED or number >= retry.attempts:
            return Tried(last=tried, attempts=number)
        await asyncio.sleep(retry.wait(number, tried.retry_after_s))


async def call_with_retries(
    call: FunctionCall, retry: Retry, attempt: Callable[[], Awaitable[Attempt[str]]], *, started: float
) -> ToolResult:
    """`with_retries` for a tool call: the output the model reads, or the failure that discards."""
    tried = await with_retries(retry, attempt)
    latency_s = time.perf_counter() - started
    if tried.last.value is not None:
        return ToolResult(
            call=call,
            output=tried.last.value,
            status=tried.last.status,
            attempts=tried.attempts,
            latency_s=latency_s,
        )
    return ToolResult(
        call=call,
        output=None,
        status=tried.last.status,
        attempts=tried.attempts,
        latency_s=latency_s,
        failure=tried.failure,
        failure_kind=tried.last.kind or INFRA_ERROR,
    )


async def grade_with_retries(retry: Retry, attempt: Callable[[], Awaitable[Attempt[float]]]) -> GradeOutcome:
    """`with_retries` for a grade: the score, or the failure that discards the rollout."""
    tried = await with_retries(retry, attempt)
    if tried.last.value is not None:
        return GradeOutcome(score=tried.last.value, status=tried.last.status, attempts=tried.attempts)
    return GradeOutcome(
        score=None,
        failure=tried.failure,
        status=tried.last.status,
        attempts=tried.attempts,
        failure_kind=tried.last.kind or INFRA_ERROR,
    )


def _error_body(answer: HttpAnswer) -> str:
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
        inject_context(headers)  # a traced rollout: the server's span of this call is its child
        content = json.dumps(body, ensure_ascii=False).encode()
        headers["Content-Type"] = "application/json"

        async def attempt() -> Attempt[str]:
            try:
                response = await self.transport.request(
                    "POST", endpoint.url, content=content, headers=headers, seconds=self.timeout_s
                )
            except TransportError as exc:
                return Attempt(failure=str(exc), kind=INFRA_ERROR)
            if response.status < 500:
                return Attempt(value=_tool_output(response), status=response.status)
            return Attempt.failed_answer(response, f"HTTP {response.status}")

        return await call_with_retries(call, self.retry, attempt, started=started)


def _tool_output(response: HttpAnswer) -> str:
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

    async def grade(self, sample: Mapping[str, Any], item: Mapping[str, Any], trace_id: str) -> GradeOutcome:
        headers = dict(self.endpoint.headers)
        if self.run:
            headers[RUN_HEADER] = self.run
        inject_context(headers)
        headers["Content-Type"] = "application/json"
        content = json.dumps(
            {"sample": sample, "item": item, "trace_id": trace_id}, ensure_ascii=False
        ).encode()

        async def attempt() -> Attempt[float]:
            try:
                response = await self.transport.request(
                    "POST", self.endpoint.url, content=content, headers=headers, seconds=self.timeout_s
                )
            except TransportError as exc:
                return Attempt(failure=str(exc), kind=INFRA_ERROR)
            score = _score(response)
            if score is not None:
                return Attempt(value=score, status=response.status)
            failure = f"HTTP {response.status}: {response.text[:300]}"
            if response.status == 200:  # an answer without a score: the grader broke, not the request
                return Attempt(failure=failure, kind=INFRA_ERROR, status=200)
            return Attempt.failed_answer(response, failure)

        return await grade_with_retries(self.retry, attempt)


def _score(response: HttpAnswer) -> float | None:
    if response.status != 200:
        return None
    try:
        data = response.json()
    except ValueError:
        return None
    score = data.get("score") if isinstance(data, dict) else None
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        return None
    # Python's json reads NaN, Infinity and integers past the largest double, which no reward is (nor
    # could the report and the export write them).
    try:
        value = float(score)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None
