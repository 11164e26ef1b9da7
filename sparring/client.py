"""A Python client for trainers: sparring's tools, graders and whole episodes, from any RL trainer.

It imports none of the server's stack (FastAPI, SQLAlchemy, Redis, ...): `pip install sparring` is
enough. It is built on the package's own pieces: tool calls go out as `sparring.http.HttpToolCaller`
sends them (the platform's envelope, retries of a 5xx with the same `call_id`, then failure),
grades as `HttpGrader` posts them, and `run_episode` is `sparring.loop.run_rollout`, the one rollout loop.

    env = Environment("https://sparring.example.com", key="...", run="grpo-7")
    schemas = env.tools()                          # chat-completions tools for the model
    with env.rollout(item=line_item) as rollout:   # owns one trace_id
        out = rollout.call("find_user_id_by_email", {"email": "a@b.c"})
        reward = rollout.grade("retail", "Done: order #W1 returned.")
    episode = env.run_episode(openai_client, line, model="my-policy", grader="retail")

`pack=` (on the environment, or on one rollout or episode) names the pack whose tools the model is
given: they are listed from that pack's own listing (`GET /tools?pack=`) and called at its routes
(`POST /packs/<pack>/tools/<name>`), so a name several enabled packs share (retail's and airline's
`calculate`) is that pack's tool. Without it, the tools are the server's unqualified ones (`/tools/<name>`).

`AsyncEnvironment` is the same with `await` (and `async with`); `Environment` runs it on a private
event loop in a background thread, so it works from plain code, threads and notebooks alike.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any, Literal, TypeVar, cast

import httpx
from openai import AsyncOpenAI, OpenAI

from sparring.conversation import HttpTranscripts
from sparring.http import Endpoint, HttpGrader, HttpToolCaller, Retry, ToolEndpoints
from sparring.loop import (
    DatasetLine,
    EpisodeLimits,
    FunctionCall,
    RolloutResult,
    Usage,
    build_sample,
    run_rollout,
)
from sparring.policies import ChatPolicy, ResponsesPolicy, chat_messages
from sparring.wire import new_call_id, new_trace_id, remote_trace_id

__all__ = [
    "AsyncEnvironment",
    "AsyncRollout",
    "Environment",
    "Episode",
    "GradeFailed",
    "Rollout",
    "ToolCallFailed",
    "remote_trace_id",
]

Api = Literal["chat", "responses"]
T = TypeVar("T")


class ToolCallFailed(RuntimeError):
    """A tool call failed for good (5xx or network error after the retries): discard the rollout."""


class GradeFailed(RuntimeError):
    """The grader failed for good: discard the rollout rather than train on a made-up reward."""


@dataclass
class Episode:
    """A finished episode: the conversation in chat form, every tool call, the reward, the trace id.

    `discarded` says why the episode must not be trained on (the model, a tool or the grader failed
    for good); `reward` is None then, and when no grader was asked for.
    """

    messages: list[dict[str, Any]]
    tool_calls: list[dict[str, Any]]
    reward: float | None
    trace_id: str
    final_text: str
    ended_by: str
    discarded: str | None = None
    usage: Usage = field(default_factory=Usage)

    @classmethod
    def from_result(cls, result: RolloutResult, *, developer_role: str = "system") -> Episode:
        calls = [
            {
                "call_id": r.call.call_id,
                "name": r.call.name,
                "arguments": r.call.arguments,
                "output": r.output,
                "status": r.status,
                "is_error": r.is_error,
            }
            for r in result.tool_results
        ]
        return cls(
            messages=chat_messages(result.transcript, developer_role=developer_role),
            tool_calls=calls,
            reward=result.score,
            trace_id=result.trace_id,
            final_text=result.final_text,
            ended_by=result.ended_by,
            discarded=result.discarded,
            usage=result.usage,
        )


def _auth(header: str, key: str | None) -> dict[str, str]:
    if key is None:
        return {}
    return {"Authorization": f"Bearer {key}"} if header.lower() == "authorization" else {header: key}


class AsyncRollout:
    """One rollout: a trace id, the dataset item its calls carry, its pack, and its calls and grades."""

    def __init__(
        self, env: AsyncEnvironment, trace_id: str, item: Mapping[str, Any], pack: str | None = None
    ) -> None:
        self.env = env
        self.trace_id = trace_id
        self.item = dict(item)
        self.pack = pack

    async def call(self, name: str, arguments: Mapping[str, Any] | str, *, call_id: str | None = None) -> str:
        """Call a tool; the output the model reads (an `Error: ...` for a model mistake)."""
        return await self.env.call(
            name, arguments, trace_id=self.trace_id, item=self.item, call_id=call_id, pack=self.pack
        )

    async def call_many(self, calls: Sequence[tuple[str, Mapping[str, Any] | str]]) -> list[str]:
        """Several calls at once, as a model's parallel calls of one turn; outputs in the same order."""
        return list(await asyncio.gather(*(self.call(name, arguments) for name, arguments in calls)))

    async def grade(
        self, grader: str | None, sample: Mapping[str, Any] | str, item: Mapping[str, Any] | None = None
    ) -> float:
        """Score this rollout; `sample` is the platform's sample, or just the final answer's text."""
        return await self.env.grade(
            grader, sample, self.item if item is None else item, trace_id=self.trace_id
        )

    async def __aenter__(self) -> AsyncRollout:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class AsyncEnvironment:
    """A sparring server as an RL environment, for asyncio code (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        key: str | None = None,
        *,
        grader_key: str | None = None,
        header: str = "Authorization",
        run: str | None = None,
        pack: str | None = None,
        retry: Retry | None = None,
        timeout_s: float = 600.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.run = run
        self.pack = pack
        self.retry = retry or Retry()
        self._owns_http = http is None
        self.http = http or httpx.AsyncClient(timeout=timeout_s)
        self.timeout_s = timeout_s
        self._tools_headers = _auth(header, key)
        self._grader_headers = _auth(header, grader_key if grader_key is not None else key)
        self._transcripts = HttpTranscripts(
            self.http, Endpoint(url=self.base_url, headers=self._grader_headers), source="client"
        )
        self._callers: dict[str | None, HttpToolCaller] = {}

    async def aclose(self) -> None:
        if self._owns_http:
            await self.http.aclose()

    async def __aenter__(self) -> AsyncEnvironment:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _caller(self, pack: str | None) -> HttpToolCaller:
        """The caller of one pack's routes (None: the unqualified `/tools/<name>`)."""
        caller = self._callers.get(pack)
        if caller is None:
            caller = self._callers[pack] = HttpToolCaller(
                self.http,
                ToolEndpoints.for_server(self.base_url, self._tools_headers, pack),
                run=self.run,
                retry=self.retry,
                timeout_s=self.timeout_s,
            )
        return caller

    async def tools(self, pack: str | None = None) -> list[dict[str, Any]]:
        """The served tools as chat-completions function tools (what a model is given): those of `pack`
        (else the environment's pack), the names it shares with other packs included; without a pack,
        the tools served at `/tools/<name>`."""
        pack = pack if pack is not None else self.pack
        params = {"pack": pack} if pack is not None else None
        response = await self.http.get(
            f"{self.base_url}/tools", params=params, headers=dict(self._tools_headers), timeout=self.timeout_s
        )
        response.raise_for_status()
        return [
            {
                "type": "function",
                "function": {
                    "name": tool["name"],
                    "description": tool["description"],
                    "parameters": tool["parameters"],
                    "strict": True,
                },
            }
            for tool in response.json()
        ]

    def rollout(
        self, *, item: Mapping[str, Any] | None = None, trace_id: str | None = None, pack: str | None = None
    ) -> AsyncRollout:
        """A rollout that owns a fresh `trace_<uuid>` (or the given one): `async with env.rollout() as r`,
        or keep the object (a trainer's environment instance holds one per episode). Its calls go to
        `pack`'s routes (else the environment's pack's)."""
        return AsyncRollout(
            self, trace_id or new_trace_id(), item or {}, pack if pack is not None else self.pack
        )

    async def call(
        self,
        name: str,
        arguments: Mapping[str, Any] | str,
        *,
        trace_id: str,
        item: Mapping[str, Any] | None = None,
        call_id: str | None = None,
        pack: str | None = None,
    ) -> str:
        """One tool call of rollout `trace_id` (at `pack`'s route, else the environment's pack's);
        ToolCallFailed when it failed for good."""
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        call = FunctionCall(call_id=call_id or new_call_id(), name=name, arguments=text)
        caller = self._caller(pack if pack is not None else self.pack)
        result = await caller.call(call, trace_id=trace_id, item=item or {})
        if result.failure is not None or result.output is None:
            raise ToolCallFailed(f"{name}: {result.failure}")
        return result.output

    def _grader(self, grader: str | None) -> HttpGrader:
        path = f"/grade/{grader}" if grader else "/grade"
        endpoint = Endpoint(url=f"{self.base_url}{path}", headers=self._grader_headers)
        return HttpGrader(self.http, endpoint, run=self.run, retry=self.retry, timeout_s=self.timeout_s)

    async def grade(
        self,
        grader: str | None,
        sample: Mapping[str, Any] | str,
        item: Mapping[str, Any] | None = None,
        *,
        trace_id: str | None = None,
    ) -> float:
        """The grader's score; GradeFailed when it failed for good."""
        full = build_sample(sample, []) if isinstance(sample, str) else dict(sample)
        result = await self._grader(grader).grade(full, item or {}, trace_id or "")
        if result.score is None:
            raise GradeFailed(f"grader {grader or '(default)'}: {result.failure}")
        return result.score

    async def run_episode(
        self,
        model_client: AsyncOpenAI | OpenAI,
        line: Mapping[str, Any],
        *,
        model: str,
        grader: str | None = None,
        api: Api = "chat",
        max_turns: int = 30,
        max_tool_calls: int = 50,
        trace_id: str | None = None,
        pack: str | None = None,
        **sampling: Any,
    ) -> Episode:
        """Run one dataset line with the model through the rollout loop, graded when `grader` is given.

        `model_client` is an `openai` client (async or sync) pointed at any OpenAI-compatible server
        (vLLM, SGLang, a trainer's own sampling server); `sampling` goes into every request. The line's
        tool calls go to `pack`'s routes (else the environment's pack's).
        """
        client = _as_async(model_client)
        policy = (
            ChatPolicy(client, model, **sampling)
            if api == "chat"
            else ResponsesPolicy(client, model, **sampling)
        )
        grading = self._grader(grader) if grader is not None else None
        result = await run_rollout(
            policy,
            self._caller(pack if pack is not None else self.pack),
            DatasetLine.from_json(line),
            grader=grading,
            limits=EpisodeLimits(max_turns=max_turns, max_tool_calls=max_tool_calls),
            trace_id=trace_id,
        )
        if grading is not None:  # the grader's key may store the conversation beside the rollout
            await self._transcripts.store(result, model=model)
        # The conversation as the model saw it: chat servers get `developer` messages as `system`.
        return Episode.from_result(result, developer_role="system" if api == "chat" else "developer")


def _as_async(client: AsyncOpenAI | OpenAI) -> AsyncOpenAI:
    """A sync `OpenAI` client seen as an async one: the policies' requests run in a thread.

    The policies (`sparring.policies`) send their requests through the SDK's generic `post`, which the
    sync client has with the same arguments.
    """
    if isinstance(client, AsyncOpenAI):
        return client

    async def post(*args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(partial(client.post, *args, **kwargs))

    return cast(AsyncOpenAI, SimpleNamespace(post=post))


class _Portal:
    """A private event loop in a daemon thread: the sync client's coroutines run there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sparring-client", daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


async def _build(factory: Any) -> Any:
    return factory()


class Rollout:
    """The sync face of `AsyncRollout`."""

    def __init__(self, env: Environment, inner: AsyncRollout) -> None:
        self._env = env
        self._inner = inner

    @property
    def trace_id(self) -> str:
        return self._inner.trace_id

    @property
    def item(self) -> dict[str, Any]:
        return self._inner.item

    @property
    def pack(self) -> str | None:
        return self._inner.pack

    def call(self, name: str, arguments: Mapping[str, Any] | str, *, call_id: str | None = None) -> str:
        return self._env._run(self._inner.call(name, arguments, call_id=call_id))

    def call_many(self, calls: Sequence[tuple[str, Mapping[str, Any] | str]]) -> list[str]:
        return self._env._run(self._inner.call_many(calls))

    def grade(
        self, grader: str | None, sample: Mapping[str, Any] | str, item: Mapping[str, Any] | None = None
    ) -> float:
        return self._env._run(self._inner.grade(grader, sample, item))

    def __enter__(self) -> Rollout:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class Environment:
    """A sparring server as an RL environment, for plain (sync) code; thread-safe."""

    def __init__(self, base_url: str, key: str | None = None, **options: Any) -> None:
        self._portal = _Portal()
        # The async environment (and its HTTP client) is made on the portal's loop, where it is used.
        self._async: AsyncEnvironment = self._portal.run(
            _build(partial(AsyncEnvironment, base_url, key, **options))
        )

    def _run(self, coroutine: Awaitable[T]) -> T:
        async def wrapped() -> T:
            return await coroutine

        return self._portal.run(wrapped())

    def close(self) -> None:
        self._portal.run(self._async.aclose())
        self._portal.close()

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def run(self) -> str | None:
        return self._async.run

    def tools(self, pack: str | None = None) -> list[dict[str, Any]]:
        return self._run(self._async.tools(pack))

    @property
    def pack(self) -> str | None:
        return self._async.pack

    def rollout(
        self, *, item: Mapping[str, Any] | None = None, trace_id: str | None = None, pack: str | None = None
    ) -> Rollout:
        """A rollout owning a fresh trace id: `with env.rollout(item=...) as r`, or kept as an object."""
        return Rollout(self, self._async.rollout(item=item, trace_id=trace_id, pack=pack))

    def call(
        self,
        name: str,
        arguments: Mapping[str, Any] | str,
        *,
        trace_id: str,
        item: Mapping[str, Any] | None = None,
        call_id: str | None = None,
        pack: str | None = None,
    ) -> str:
        return self._run(
            self._async.call(name, arguments, trace_id=trace_id, item=item, call_id=call_id, pack=pack)
        )

    def grade(
        self,
        grader: str | None,
        sample: Mapping[str, Any] | str,
        item: Mapping[str, Any] | None = None,
        *,
        trace_id: str | None = None,
    ) -> float:
        return self._run(self._async.grade(grader, sample, item, trace_id=trace_id))

    def run_episode(
        self, model_client: AsyncOpenAI | OpenAI, line: Mapping[str, Any], **options: Any
    ) -> Episode:
        """`AsyncEnvironment.run_episode`; pass a sync `OpenAI` client (an async one must belong to no
        other event loop, since the episode runs on this environment's own loop)."""
        return self._run(self._async.run_episode(model_client, line, **options))
