"""A small OpenAI-compatible model server the runner tests start on 127.0.0.1, driven by a per-test script.

It speaks `POST /v1/responses` and `POST /v1/chat/completions` with function calling (several calls
in one turn are parallel calls). Each request is reduced to a `ModelRequest` (the user's last
message, the calls made so far and their outputs, in order) and handed to the test's script, which
answers a `Reply` (text and/or calls). Every request body is kept for assertions. A script may also
raise `Unavailable` to answer 503. The pre-flight turn of `sparring eval` (`PREFLIGHT_PROMPT`, no
tools) is answered "ok" by the server itself and kept in `preflights`, not handed to the script.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request, Response

from sparring.policies import PREFLIGHT_PROMPT

INPUT_TOKENS, OUTPUT_TOKENS = 11, 7  # usage reported for every turn


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass
class ModelRequest:
    api: str
    model: str
    user: str  # the last user message
    system: str  # the first system/developer message
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (call_id, name, arguments) so far
    outputs: list[tuple[str, str]] = field(default_factory=list)  # (call_id, output) so far, in order
    tools: list[str] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    text: str = ""
    calls: tuple[Call, ...] = ()


class Unavailable(Exception):
    pass


Script = Callable[[ModelRequest], Reply]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def parse_responses(body: dict[str, Any]) -> ModelRequest:
    request = ModelRequest(api="responses", model=body["model"], user="", system="", body=body)
    items = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
    for entry in items:
        kind = entry.get("type", "message")
        if kind == "function_call":
            request.calls.append((entry["call_id"], entry["name"], entry["arguments"]))
        elif kind == "function_call_output":
            request.outputs.append((entry["call_id"], entry["output"]))
        elif entry.get("role") == "user":
            request.user = _text(entry.get("content"))
        elif entry.get("role") in ("system", "developer") and not request.system:
            request.system = _text(entry.get("content"))
    request.tools = [tool["name"] for tool in body.get("tools") or []]
    return request


def parse_chat(body: dict[str, Any]) -> ModelRequest:
    request = ModelRequest(api="chat", model=body["model"], user="", system="", body=body)
    for message in body["messages"]:
        role = message.get("role")
        if role == "assistant":
            for call in message.get("tool_calls") or []:
                request.calls.append((call["id"], call["function"]["name"], call["function"]["arguments"]))
        elif role == "tool":
            request.outputs.append((message["tool_call_id"], _text(message.get("content"))))
        elif role == "user":
            request.user = _text(message.get("content"))
        elif role in ("system", "developer") and not request.system:
            request.system = _text(message.get("content"))
    request.tools = [tool["function"]["name"] for tool in body.get("tools") or []]
    return request


class ModelServer:
    """The app served by uvicorn in a thread on a free loopback port; `script` answers every turn."""

    def __init__(self) -> None:
        self.script: Script = lambda request: Reply(text="no script")
        self.requests: list[ModelRequest] = []
        self.preflights: list[ModelRequest] = []  # `sparring eval`'s pre-flight turns, answered "ok"
        # Ids of calls numbered within each answer (`call_0`, `call_1`, ... every time), as some model
        # servers number them, rather than unique ones.
        self.ids_per_answer = False
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def _call_id(self, answer: int, index: int) -> str:
        return f"call_{index}" if self.ids_per_answer else f"call_{answer}_{index}"

    def _answer(self, request: ModelRequest) -> Reply | None:
        if request.user == PREFLIGHT_PROMPT and not request.tools:
            with self._lock:
                self.preflights.append(request)
            return Reply(text="ok")
        with self._lock:
            self.requests.append(request)
        try:
            return self.script(request)
        except Unavailable:
            return None

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/responses")
        async def responses(raw: Request) -> Response:
            body = orjson.loads(await raw.body())
            reply = self._answer(parse_responses(body))
            if reply is None:
                return Response(status_code=503, headers={"retry-after-ms": "1"}, content=b'{"error": {}}')
            n = self._next_id()
            output: list[dict[str, Any]] = []
            for i, call in enumerate(reply.calls):
                output.append(
                    {
                        "type": "function_call",
                        "id": f"fc_{n}_{i}",
                        "call_id": self._call_id(n, i),
                        "name": call.name,
                        "arguments": orjson.dumps(call.arguments).decode(),
                        "status": "completed",
                    }
                )
            if reply.text or not reply.calls:
                output.append(
                    {
                        "type": "message",
                        "id": f"msg_{n}",
                        "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": reply.text, "annotations": []}],
                    }
                )
            payload = {
                "id": f"resp_{n}",
                "object": "response",
                "created_at": 0,
                "model": body["model"],
                "status": "completed",
                "output": output,
                "parallel_tool_calls": True,
                "tool_choice": "auto",
                "tools": [],
                "usage": {
                    "input_tokens": INPUT_TOKENS,
                    "output_tokens": OUTPUT_TOKENS,
                    "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS,
                    "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens_details": {"reasoning_tokens": 0},
                },
            }
            return Response(content=orjson.dumps(payload), media_type="application/json")

        @app.post("/v1/chat/completions")
        async def chat(raw: Request) -> Response:
            body = orjson.loads(await raw.body())
            reply = self._answer(parse_chat(body))
            if reply is None:
                return Response(status_code=503, headers={"retry-after-ms": "1"}, content=b'{"error": {}}')
            n = self._next_id()
            message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
            if reply.calls:
                message["tool_calls"] = [
                    {
                        "id": self._call_id(n, i),
                        "type": "function",
                        "function": {"name": call.name, "arguments": orjson.dumps(call.arguments).decode()},
                    }
                    for i, call in enumerate(reply.calls)
                ]
            payload = {
                "id": f"chatcmpl-{n}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {"index": 0, "message": message, "finish_reason": "tool_calls" if reply.calls else "stop"}
                ],
                "usage": {
                    "prompt_tokens": INPUT_TOKENS,
                    "completion_tokens": OUTPUT_TOKENS,
                    "total_tokens": INPUT_TOKENS + OUTPUT_TOKENS,
                },
            }
            return Response(content=orjson.dumps(payload), media_type="application/json")

        return app

    def start(self) -> ModelServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test model server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
