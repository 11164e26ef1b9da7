"""The runner tests' scripted model, reached as eval-protocol reaches a model, plus its tracing gateway.

The model is `tests.runner.model_server.ModelServer`'s app (chat completions with parallel calls),
served behind a front that eval-protocol's URLs need and the runner's tests do not:

- `POST <any prefix>/chat/completions` reaches the model, so a tracing-style base URL
  (`/rollout_id/<id>/invocation_id/...`) works; every prefix is recorded; a request with
  `"stream": true` is answered as an event stream, as servers answer it;
- the request's `model` names a script, a list of `Turn`s; the turn played is the number of assistant
  messages already in the request, so any number of rollouts run at once without state here;
  model `down` answers 503, model `hold` answers only once `release()` is called, model `stall` never
  answers (until the server stops); model `flaky` plays its script, but on a rollout whose end the
  gateway has not yet seen fail it answers 503 from its second turn on (so a rollout's first attempt
  changes state, then fails, and its retry succeeds);
- hostile models, as a model server may behave: `forbidden` answers 403 with an internal service's
  error text (`SECRET`), `garbage` a 200 that is not JSON, `truncated` a 200 of cut JSON, `keyed` a
  200 whose `choices` is an object keyed by index rather than a list, `surrogate` a chat completion
  (and Responses answer, its reasoning summary too) answering `SURROGATE_ANSWER`, whose JSON escapes
  a lone surrogate (no UTF-8 encoder writes it back), `trickle` a 200 whose body comes one byte every
  0.2 s for two minutes, `huge` a valid completion of
  `HUGE_TEXT` bytes, `huge-gzip` the same compressed to a few kilobytes, `redirect` a 307 to
  `redirect_to`;
- eval-protocol's tracing gateway, as its processor and logging handler (eval-protocol 0.3.33's
  `FireworksTracingAdapter`, `FireworksTracingHttpHandler`) speak to it: `POST /logs` keeps the logs a
  rollout server posts, `GET /v1/status?rollout_id=` answers the status of the last one tagged with
  that rollout, `GET /logs?tags=` answers the logs with those tags (`entries`, newest first), and
  `GET /v1/traces/pointwise?tags=` the trace of the rollout's last completion (its request's messages
  and the model's answer), as the tracing proxy records it from the model URL's path; `POST /held/logs`
  keeps a log as `/logs` does, but between `hold_logs()` and `release_logs()` answers one that is not
  RUNNING only on the release (a slow gateway).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, Query, Request, Response
from starlette.types import Message, Receive, Scope, Send

from tests.runner.model_server import Call, ModelRequest, Reply, Unavailable
from tests.runner.model_server import ModelServer as ScriptedModel

CHAT = "/chat/completions"
TRICKLING_LOGS = "/trickle/logs"  # a gateway whose answer to a log trickles, as model `trickle` does
RESPONSES = "/responses"  # hostile models only: the runner's `sparring eval` tests speak both APIs
SECRET = "internal-billing-service: token=hunter2"
SURROGATE_ANSWER = "103 \\ud800"  # as JSON text: 103, then a lone surrogate
HUGE_TEXT = 1_200_000  # over 1 MiB, the grade routes' limit, and under the remote's default model cap


def rollout_of(path: str) -> str | None:
    """The rollout id in a tracing URL's path (`.../rollout_id/<id>/...`), if it has one."""
    parts = path.split("/")
    return parts[parts.index("rollout_id") + 1] if "rollout_id" in parts[:-1] else None


def completion(text: str) -> bytes:
    """A valid chat completion whose answer is `text`."""
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    return json.dumps(body).encode()


@dataclass(frozen=True)
class Turn:
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    text: str = ""


HOSTILE = {
    "forbidden": "_forbidden",
    "garbage": "_garbage",
    "truncated": "_truncated",
    "keyed": "_keyed",
    "surrogate": "_surrogate",
    "trickle": "_trickle",
    "huge": "_huge",
    "huge-gzip": "_huge_gzip",
    "redirect": "_redirect",
}


class ModelServer:
    def __init__(self) -> None:
        self.scripts: dict[str, list[Turn]] = {}
        self.prefixes: list[str] = []
        self.logs: list[dict[str, Any]] = []
        self.log_headers: list[dict[str, str]] = []
        self.traces: dict[str, dict[str, Any]] = {}  # rollout id -> its last completion
        self._released = threading.Event()
        self._logs_released = threading.Event()
        self._logs_released.set()
        self._stopping = threading.Event()
        self.redirect_to = ""
        self._model = ScriptedModel()
        self._model.script = self._play
        self._chat = self._model._app()
        self._gateway = self._gateway_app()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(
            self._front, interface="asgi3", log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def _play(self, request: ModelRequest) -> Reply:
        if request.model == "down":
            raise Unavailable
        if request.model == "hold":
            return Reply(text="released")
        turns = self.scripts[request.model]
        index = sum(1 for m in request.body["messages"] if m.get("role") == "assistant")
        turn = turns[min(index, len(turns) - 1)]
        return Reply(text=turn.text, calls=tuple(Call(name, arguments) for name, arguments in turn.calls))

    async def _front(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        responses = scope["type"] == "http" and path.endswith(RESPONSES)
        if scope["type"] == "http" and path.endswith(TRICKLING_LOGS):
            while (await receive()).get("more_body"):
                pass
            await self._trickle(send)
            return
        if scope["type"] != "http" or not (path.endswith(CHAT) or responses):
            await self._gateway(scope, receive, send)
            return
        self.prefixes.append(path[1 : -len(RESPONSES if responses else CHAT)])
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if not message.get("more_body"):
                break
        body = b"".join(m.get("body", b"") for m in messages)
        request = json.loads(body)
        model = request.get("model")
        rollout_id = rollout_of(path)
        if model == "hold":
            await asyncio.to_thread(self._released.wait, 60)
        if model == "stall":
            await self._stall()
            await self._answer(send, 503, b'{"error": {"message": "stalled"}}')
            return
        if model in HOSTILE:
            await getattr(self, HOSTILE[model])(send)
            return
        if model == "flaky" and self._fails(rollout_id, request):
            await self._answer(send, 503, b'{"error": {"message": "overloaded"}}')
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        chat = "/v1" + CHAT
        sent = send if rollout_id is None else self._tracer(rollout_id, request, send)
        if request.get("stream") is True:
            sent = self._streaming(sent)
        await self._chat({**scope, "path": chat, "raw_path": chat.encode()}, replay, sent)

    def _streaming(self, send: Send) -> Send:
        """`send`, answering as a server answers a `"stream": true` request: the model's completion as an
        event stream (one chunk holding the whole message, then `[DONE]`)."""
        start: list[Message] = []
        chunks: list[bytes] = []

        async def streamed(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.append(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            if start[0]["status"] != 200:
                await send(start[0])
                await send({"type": "http.response.body", "body": b"".join(chunks)})
                return
            answer = json.loads(b"".join(chunks))
            choice = answer["choices"][0]
            delta = {"index": 0, "delta": choice["message"], "finish_reason": choice["finish_reason"]}
            chunk = {**answer, "object": "chat.completion.chunk", "choices": [delta]}
            events = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            await self._answer(send, 200, events, b"text/event-stream")

        return streamed

    def _fails(self, rollout_id: str | None, request: dict[str, Any]) -> bool:
        """`flaky`: past its first turn, down until the gateway saw the rollout fail once."""
        turn = sum(1 for m in request.get("messages", []) if m.get("role") == "assistant")
        failed = any(
            (log.get("status") or {}).get("code") not in (100, 101) for log in self.tagged(rollout_id or "")
        )
        return turn >= 1 and not failed

    async def _stall(self) -> None:
        await asyncio.to_thread(self._stopping.wait, 60)

    def _tracer(self, rollout_id: str, request: dict[str, Any], send: Send) -> Send:
        """`send`, recording a successful completion as the rollout's trace (the tracing proxy's job)."""
        chunks: list[bytes] = []
        status = [0]

        async def traced(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            else:
                chunks.append(message.get("body", b""))
                if status[0] == 200 and not message.get("more_body"):
                    answer = json.loads(b"".join(chunks))["choices"][0]["message"]
                    self.traces[rollout_id] = {
                        "id": f"trace-{rollout_id}",
                        "tags": [f"rollout_id:{rollout_id}"],
                        "input": {"messages": request.get("messages", []), "tools": request.get("tools")},
                        "output": answer,
                    }
            await send(message)

        return traced

    @property
    def requests(self) -> list[ModelRequest]:
        """Every request the scripted model answered, its body included."""
        return self._model.requests

    def tagged(self, rollout_id: str) -> list[dict[str, Any]]:
        """The logs posted for `rollout_id`, oldest first."""
        return [log for log in self.logs if f"rollout_id:{rollout_id}" in log.get("tags", [])]

    async def _answer(
        self, send: Send, status: int, body: bytes, content_type: bytes = b"application/json", **headers: str
    ) -> None:
        fields = [(b"content-type", content_type)] + [
            (name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()
        ]
        await send({"type": "http.response.start", "status": status, "headers": fields})
        await send({"type": "http.response.body", "body": body})

    async def _forbidden(self, send: Send) -> None:
        await self._answer(send, 403, json.dumps({"error": {"message": SECRET}}).encode())

    async def _garbage(self, send: Send) -> None:
        await self._answer(send, 200, b"<html>not a completion</html>", b"text/html")

    async def _truncated(self, send: Send) -> None:
        await self._answer(send, 200, completion("cut")[:40])

    async def _keyed(self, send: Send) -> None:
        body = json.loads(completion("keyed"))
        body["choices"] = dict(enumerate(body["choices"]))  # {"0": choice}, as JSON writes it
        await self._answer(send, 200, json.dumps(body).encode())

    async def _surrogate(self, send: Send) -> None:
        """A chat completion that is also a Responses answer (with a reasoning summary), for both APIs."""
        body = json.loads(completion("placeholder"))
        body["output"] = [
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "placeholder"}]},
            {"type": "message", "id": "msg_1", "role": "assistant", "content": [
                {"type": "output_text", "text": "placeholder", "annotations": []}
            ]},
        ]  # fmt: skip
        answer = json.dumps(body).encode().replace(b"placeholder", SURROGATE_ANSWER.encode())
        await self._answer(send, 200, answer)

    async def _huge(self, send: Send) -> None:
        await self._answer(send, 200, completion("a" * HUGE_TEXT))

    async def _huge_gzip(self, send: Send) -> None:
        await self._answer(send, 200, gzip.compress(completion("a" * HUGE_TEXT)), content_encoding="gzip")

    async def _redirect(self, send: Send) -> None:
        await self._answer(send, 307, b"{}", location=self.redirect_to)

    async def _trickle(self, send: Send) -> None:
        """Never idle long enough for a read timeout, never done: one byte every 0.2 s."""
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
        await send(start)
        ends = time.monotonic() + 120
        while time.monotonic() < ends and not self._stopping.is_set():
            await send({"type": "http.response.body", "body": b" ", "more_body": True})
            await asyncio.sleep(0.2)
        await send({"type": "http.response.body", "body": completion("late")})

    def _gateway_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/logs")
        async def logs(request: Request) -> Response:
            self.logs.append(await request.json())
            self.log_headers.append(dict(request.headers))
            return Response(b"{}", media_type="application/json")

        @app.post("/held/logs")
        async def held_logs(request: Request) -> Response:
            entry = await request.json()
            self.logs.append(entry)
            if (entry.get("status") or {}).get("code") != 101:
                await asyncio.to_thread(self._logs_released.wait, 60)
            return Response(b"{}", media_type="application/json")

        @app.get("/v1/status")
        async def status(rollout_id: str) -> dict[str, Any]:
            tagged = self.tagged(rollout_id)
            return {"rollout_id": rollout_id, "status": tagged[-1]["status"] if tagged else None}

        @app.get("/logs")
        async def search(tags: Annotated[list[str], Query()]) -> dict[str, Any]:
            found = [log for log in self.logs if set(tags) <= set(log.get("tags", []))]
            return {"entries": found[::-1]}

        @app.get("/v1/traces/pointwise")
        async def traces(tags: Annotated[list[str], Query()]) -> dict[str, Any]:
            ids = [tag.split(":", 1)[1] for tag in tags if tag.startswith("rollout_id:")]
            return {"traces": [self.traces[i] for i in ids if i in self.traces]}

        return app

    def tracing_url(self, rollout_id: str, row_id: str = "row-1") -> str:
        """A model base URL as eval-protocol builds it for its tracing gateway (this server)."""
        return (
            f"http://127.0.0.1:{self.port}/rollout_id/{rollout_id}/invocation_id/inv-1"
            f"/experiment_id/exp-1/run_id/run-1/row_id/{row_id}"
        )

    def base_url(self, path: str = "v1") -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def release(self) -> None:
        self._released.set()

    def hold_logs(self) -> None:
        self._logs_released.clear()

    def release_logs(self) -> None:
        self._logs_released.set()

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the scripted model server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._released.set()
        self._logs_released.set()
        self._stopping.set()
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
        self._model._socket.close()  # bound by the runner's server, which is never started here
