"""`sparring eval` against a served sparring process, both exporting to one OTLP receiver: one trace per
rollout, the command's `invoke_agent` and `chat` spans with the server's `execute_tool` and `grade`
spans under them (the W3C traceparent crosses the process boundary)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL
from tests.runner.model_server import Call, ModelRequest, ModelServer, Reply
from tests.runner.test_cli import run_cli
from tests.runner.test_loop import GRADERS, counter_line
from tests.system.helpers import Servers, server_settings
from tests.telemetry.receiver import OtlpReceiver


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    started = Servers(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


async def test_sparring_eval_and_the_server_make_one_trace_per_rollout(
    servers: Servers, pg_database: str, receiver: OtlpReceiver, model_server: ModelServer, tmp_path: Path
) -> None:
    def script(request: ModelRequest) -> Reply:
        if not request.outputs:
            return Reply(calls=(Call("increment", {"by": 1, "name": None}),))
        return Reply(text="The counter is now 101.")

    model_server.script = script
    graders = tmp_path / "graders.yaml"
    graders.write_text(GRADERS, encoding="utf-8")
    tracing = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
    settings = server_settings(
        database_url=pg_database,
        redis_url=REDIS_URL,
        home=tmp_path / "server-home",
        worker="traced",
        SPARRING_GRADERS_FILE=str(graders),
        OTEL_SERVICE_NAME="sparring-server",
        **tracing,
    )
    server = await servers.start("traced", settings)
    line = counter_line("101")
    dataset = tmp_path / "one.jsonl"
    dataset.write_text(json.dumps({**line.item, "tools": line.tools}) + "\n", encoding="utf-8")
    done = await run_cli(
        tmp_path,
        "eval", "--dataset", str(dataset), "--model", "scripted", "--base-url", model_server.base_url,
        "--api", "chat", "--server", server.url, "--grader", "says", "--run", "traced-cli", "--samples", "2",
        OPENAI_API_KEY="test-key", **tracing,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    spans = await receiver.wait_for(
        lambda got: (
            sum(s.name == "grade says" for s in got) >= 2 and sum(s.name == "invoke_agent" for s in got) >= 2
        )
    )

    rollouts = [s for s in spans if s.name == "invoke_agent"]
    assert len(rollouts) == 2 and len({s.trace_id for s in rollouts}) == 2
    for rollout in rollouts:
        assert rollout.resource["service.name"] == "sparring" and rollout.parent_span_id == ""
        assert rollout.attributes["sparring.run"] == "traced-cli"
        under = sorted(
            (s for s in spans if s.trace_id == rollout.trace_id and s.parent_span_id == rollout.span_id),
            key=lambda s: s.start_ns,
        )
        assert [s.name for s in under] == [
            "chat scripted",
            "execute_tool increment",
            "chat scripted",
            "grade says",
        ]
        server_spans = [s for s in under if not s.name.startswith("chat")]
        assert {s.resource["service.name"] for s in server_spans} == {"sparring-server"}
        conversation = rollout.attributes["gen_ai.conversation.id"]
        assert {s.attributes["gen_ai.conversation.id"] for s in under} == {conversation}
