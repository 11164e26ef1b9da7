"""A small OpenAI-compatible server the judge tests start on 127.0.0.1: deterministic by model name.

chat completions (the model name picks the behaviour; the last message's text is called PROMPT):
- `echo`: {"steps": [...], "result": <PROMPT parsed as a number, else PROMPT as text>}
- `label`: {"steps": [...], "result": PROMPT}
- `words`: {"result": "high"} (a non-numeric result)
- `prose`: plain text, not JSON
- `empty`: no content
- `fenced`: the echo answer inside a ```json fence
- `bare`: PROMPT alone (a server ignoring the schema)
- `down`: 503 with `retry-after-ms: 1` (so the SDK's retries are quick)
- `forbidden`: 401
- `slow`: answers after SLOW_SECONDS
- a 200 that is no whole completion (BROKEN): `html` (a proxy's page), `error200` (`{"error": ...}`),
  `noobject` (`{}`), `nullmessage`, `numbercontent`, `cut` (finish_reason `length`)
embeddings: a 26-letter histogram of each text (`down` as the model: 503; `nodata`: `data` empty,
`nullvector`: an embedding of null).
Every request is counted per model, and the last body is kept.
"""

from __future__ import annotations

import asyncio
import socket
import string
import threading
import time
from collections import Counter
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request, Response

SLOW_SECONDS = 3.0


def _prompt(body: dict[str, Any]) -> str:
    content = body["messages"][-1]["content"]
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return str(content)


def _completion(model: str, content: str | None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
    }


def _broken(model: str) -> Response | None:
    """The 200 answer of a judge model named in BROKEN, else None."""
    cut = _completion(model, '{"steps": [], "result": 0.')
    cut["choices"][0]["finish_reason"] = "length"
    null_message, number_content = _completion(model, None), _completion(model, None)
    null_message["choices"][0]["message"] = None
    number_content["choices"][0]["message"]["content"] = 0.9
    answers: dict[str, tuple[str, bytes]] = {
        "html": ("text/html", b"<html><body>502 Bad Gateway</body></html>"),
        "error200": ("application/json", b'{"error": {"message": "model overloaded"}}'),
        "noobject": ("application/json", b"{}"),
        "nullmessage": ("application/json", orjson.dumps(null_message)),
        "numbercontent": ("application/json", orjson.dumps(number_content)),
        "cut": ("application/json", orjson.dumps(cut)),
    }
    if model not in answers:
        return None
    media_type, content = answers[model]
    return Response(content=content, media_type=media_type)


BROKEN = ("html", "error200", "noobject", "nullmessage", "numbercontent", "cut")


def _number_or_text(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def create_judge_app(requests: Counter[str], last: dict[str, Any]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        model = body["model"]
        requests[model] += 1
        last["chat"] = body
        prompt = _prompt(body)
        steps = [{"description": "compared", "conclusion": "done"}]
        if model == "down":
            return Response(status_code=503, headers={"retry-after-ms": "1"}, content=b'{"error": {}}')
        if model == "forbidden":
            return Response(status_code=401, content=b'{"error": {"message": "bad key"}}')
        if model == "slow":
            await asyncio.sleep(SLOW_SECONDS)
        broken = _broken(model)
        if broken is not None:
            return broken
        if model == "words":
            content: str | None = orjson.dumps({"steps": steps, "result": "high"}).decode()
        elif model == "prose":
            content = "I would say it deserves about 0.8."
        elif model == "empty":
            content = None
        elif model == "bare":
            content = prompt
        elif model == "label":
            content = orjson.dumps({"steps": steps, "result": prompt}).decode()
        else:
            content = orjson.dumps({"steps": steps, "result": _number_or_text(prompt)}).decode()
            if model == "fenced":
                content = f"```json\n{content}\n```"
        return Response(content=orjson.dumps(_completion(model, content)), media_type="application/json")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = await request.json()
        model = body["model"]
        requests[f"embeddings:{model}"] += 1
        last["embeddings"] = body
        if model == "down":
            return Response(status_code=503, headers={"retry-after-ms": "1"}, content=b'{"error": {}}')
        if model in ("nodata", "nullvector"):
            vector = [] if model == "nodata" else [{"object": "embedding", "index": 0, "embedding": None}]
            payload = {"object": "list", "data": vector, "model": model}
            return Response(content=orjson.dumps(payload), media_type="application/json")
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": [float(text.lower().count(letter)) for letter in string.ascii_lowercase],
            }
            for i, text in enumerate(texts)
        ]
        payload = {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        }
        return Response(content=orjson.dumps(payload), media_type="application/json")

    return app


class JudgeServer:
    """The app above served by uvicorn in a thread, on a free loopback port."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.last: dict[str, Any] = {}
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(
            create_judge_app(self.requests, self.last),
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test judge server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
