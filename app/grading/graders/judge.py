"""The judge: an OpenAI-compatible chat and embeddings endpoint, through the `openai` SDK, with a cache.

Answers are cached in-process (LRU, bounded) under a hash of the model, the rendered messages and the
parameters, and identical requests in flight at the same moment share one API call: at a training step
boundary many rollouts of the same prompt often reach the same answer. Retries with backoff are the
SDK's (`max_retries`); when they are exhausted, or the endpoint answers an error, grading raises
GraderUnavailable (a 503 for the platform, which retries and then discards the rollout) rather than
inventing a score.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import openai
import orjson

from app.grading.graders.model import GraderUnavailable

T = TypeVar("T")


@dataclass(frozen=True)
class JudgeSettings:
    base_url: str | None = None  # None: the OpenAI API
    api_key: str | None = None
    timeout: float = 60.0
    max_retries: int = 3
    cache_size: int = 4096

    @property
    def configured(self) -> bool:
        return bool(self.base_url or self.api_key)


class AnswerCache:
    """A bounded least-recently-used map from request hash to answer."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> tuple[bool, Any]:
        if key in self._entries:
            self._entries.move_to_end(key)
            self.hits += 1
            return True, self._entries[key]
        self.misses += 1
        return False, None

    def put(self, key: str, value: Any) -> None:
        if self.size <= 0:
            return
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


def request_key(kind: str, payload: Any) -> str:
    return hashlib.sha256(
        kind.encode() + b"\0" + orjson.dumps(payload, option=orjson.OPT_SORT_KEYS, default=str)
    ).hexdigest()


class Judge:
    """Chat completions and embeddings against the configured endpoint; the client is built on first use."""

    def __init__(self, settings: JudgeSettings) -> None:
        self.settings = settings
        self.cache = AnswerCache(settings.cache_size)
        self.api_calls = 0
        self._client: openai.AsyncOpenAI | None = None
        self._inflight: dict[str, asyncio.Task[Any]] = {}

    @property
    def client(self) -> openai.AsyncOpenAI:
        if self._client is None:
            self._client = openai.AsyncOpenAI(
                base_url=self.settings.base_url,
                # A local OpenAI-compatible server usually takes any key; the SDK insists on one.
                api_key=self.settings.api_key or "unused",
                timeout=self.settings.timeout,
                max_retries=self.settings.max_retries,
            )
        return self._client

    @property
    def where(self) -> str:
        return self.settings.base_url or "the OpenAI API"

    async def chat(
        self,
        *,
        model: str,
        messages: Sequence[dict[str, Any]],
        params: dict[str, Any],
        response_format: dict[str, Any] | None,
    ) -> str | None:
        """The content of the first choice (None if the judge gave none, e.g. a refusal)."""
        payload = {"model": model, "messages": list(messages), "params": params, "format": response_format}

        async def call() -> str | None:
            extra: dict[str, Any] = dict(params)
            if response_format is not None:
                extra["response_format"] = response_format
            response: Any = await self.client.chat.completions.create(
                model=model,
                messages=list(messages),  # type: ignore[arg-type]
                **extra,
            )
            return _content(response)

        return await self._cached(request_key("chat", payload), call)

    async def embed(self, model: str, texts: Sequence[str]) -> list[list[float]]:
        """One embedding per text, each cached on its own (a reference is shared by many samples)."""

        def fetch(text: str) -> Callable[[], Awaitable[list[float]]]:
            async def call() -> list[float]:
                response: Any = await self.client.embeddings.create(model=model, input=[text])
                data = getattr(response, "data", None)
                vector = getattr(data[0], "embedding", None) if isinstance(data, list) and data else None
                if (
                    not isinstance(vector, list)
                    or not vector
                    or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in vector)
                ):
                    raise _Unusable("no embedding in the answer")
                return [float(x) for x in vector]

            return call

        return list(
            await asyncio.gather(
                *(self._cached(request_key("embedding", [model, text]), fetch(text)) for text in texts)
            )
        )

    async def _cached(self, key: str, call: Callable[[], Awaitable[T]]) -> T:
        found, value = self.cache.get(key)
        if found:
            return value  # type: ignore[no-any-return]
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._call(key, call))
            self._inflight[key] = task
            task.add_done_callback(lambda done: self._settle(key, done))
        # Shielded: one waiter giving up must not cancel the call the others are waiting for.
        return await asyncio.shield(task)

    async def _call(self, key: str, call: Callable[[], Awaitable[T]]) -> T:
        self.api_calls += 1
        try:
            value = await call()
        except openai.APIStatusError as exc:
            raise GraderUnavailable(
                f"judge at {self.where} answered HTTP {exc.status_code}: {_short(exc.message)}"
            ) from exc
        except openai.APITimeoutError as exc:
            raise GraderUnavailable(
                f"judge at {self.where} timed out after {self.settings.timeout:g}s "
                f"({self.settings.max_retries} retries)"
            ) from exc
        except openai.APIConnectionError as exc:
            raise GraderUnavailable(
                f"judge at {self.where} unreachable after {self.settings.max_retries} retries: "
                f"{_short(str(exc))}"
            ) from exc
        except openai.OpenAIError as exc:
            raise GraderUnavailable(f"judge at {self.where} failed: {_short(str(exc))}") from exc
        except (_Unusable, ValueError, TypeError, AttributeError) as exc:
            # A 200 that is no completion (a proxy's error page, `{"error": ...}`, a cut answer, data the
            # SDK cannot decode): the judge failed, never a verdict of 0, and nothing is cached.
            raise GraderUnavailable(
                f"judge at {self.where} answered no usable completion: {_short(str(exc))}"
            ) from exc
        self.cache.put(key, value)
        return value

    def _settle(self, key: str, task: asyncio.Task[Any]) -> None:
        self._inflight.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved, so an unawaited failure is not logged as lost

    async def aclose(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
        if self._client is not None:
            await self._client.close()
            self._client = None


class _Unusable(Exception):
    """The judge's 200 answer holds no completion to read."""


def _content(response: Any) -> str | None:
    """The content of a chat completion's first choice (None: the judge gave none, e.g. a refusal);
    _Unusable when the answer is not a whole completion."""
    choices = getattr(response, "choices", None)
    if not isinstance(choices, list):
        error = response.get("error") if isinstance(response, dict) else getattr(response, "error", None)
        said = f": {_short(str(error))}" if error else ""
        raise _Unusable(f"no choices{said} ({_short(type(response).__name__)})")
    if not choices:
        return None
    choice = choices[0]
    if getattr(choice, "finish_reason", None) == "length":
        raise _Unusable(
            "its answer was cut at the token limit (finish_reason length): raise the grader's "
            "sampling_params.max_completions_tokens"
        )
    message = getattr(choice, "message", None)
    if message is None:
        raise _Unusable("its first choice has no message")
    content = getattr(message, "content", None)
    if content is not None and not isinstance(content, str):
        raise _Unusable(f"its content is {type(content).__name__}, not text")
    return content


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
