"""An instant target for the rollout-runner benchmark: tools, grader and model that answer at once.

A bare ASGI app (no framework, no validation), so nearly all the CPU a run spends on this side is
uvicorn's, and the runner's own cost stands out:

- `POST /tools/{name}`: the `function_call_output` echoing the ids, output "ok";
- `POST /grade/{name}`: `{"score": 1.0}`;
- `POST /v1/responses` and `POST /v1/chat/completions`: `CALLS` parallel calls of `lookup` per turn
  until the conversation holds `TURNS * CALLS` tool outputs, then a final answer.

    uvicorn bench.runner_target:app
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

TURNS = int(os.environ.get("RUNNER_BENCH_TURNS", "5"))
CALLS = int(os.environ.get("RUNNER_BENCH_CALLS", "2"))
USAGE = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _json(send: Send, payload: Any, status: int = 200) -> None:
    body = orjson.dumps(payload)
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})


def _responses(body: dict[str, Any], n: int) -> dict[str, Any]:
    done = sum(1 for entry in body["input"] if entry.get("type") == "function_call_output")
    if done < TURNS * CALLS:
        output = [
            {
                "type": "function_call",
                "id": f"fc_{n}_{i}",
                "call_id": f"call_{n}_{i}",
                "name": "lookup",
                "arguments": orjson.dumps({"key": done + i}).decode(),
                "status": "completed",
            }
            for i in range(CALLS)
        ]
    else:
        output = [
            {
                "type": "message",
                "id": f"msg_{n}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "done", "annotations": []}],
            }
        ]
    return {
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
            **USAGE,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def _chat(body: dict[str, Any], n: int) -> dict[str, Any]:
    done = sum(1 for message in body["messages"] if message.get("role") == "tool")
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if done < TURNS * CALLS:
        message["tool_calls"] = [
            {
                "id": f"call_{n}_{i}",
                "type": "function",
                "function": {"name": "lookup", "arguments": orjson.dumps({"key": done + i}).decode()},
            }
            for i in range(CALLS)
        ]
    else:
        message["content"] = "done"
    return {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion",
        "created": 0,
        "model": body["model"],
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if done < TURNS * CALLS else "stop",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


_counter = 0


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    global _counter
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    path: str = scope["path"]
    if scope["method"] == "GET":
        await _json(send, {"status": "ok"} if path == "/healthz" else [])
        return
    body = orjson.loads(await _body(receive) or b"{}")
    _counter += 1
    if path.startswith("/tools/"):
        await _json(
            send,
            {
                "type": "function_call_output",
                "call_id": body.get("call_id"),
                "id": body.get("id"),
                "output": "ok",
            },
        )
    elif path.startswith("/grade"):
        await _json(send, {"score": 1.0})
    elif path == "/v1/responses":
        await _json(send, _responses(body, _counter))
    elif path == "/v1/chat/completions":
        await _json(send, _chat(body, _counter))
    else:
        await _json(send, {"error": {"code": "not_found", "message": path}}, status=404)
