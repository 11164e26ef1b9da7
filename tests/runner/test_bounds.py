"""What a model server can make `sparring eval` and the loop do is bounded: how long one model turn takes,
how much of an answer is read, what a turn of countless calls sends to the grader."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from app.main import create_app
from sparring.http import HttpGrader, HttpToolCaller
from sparring.loop import DatasetLine, EpisodeLimits, ModelFailure, Transcript, run_rollout
from sparring.policies import APIS, make_policy, model_client
from tests.conftest import GRADER_KEY, TOOLS_KEY, AppFactory, make_settings
from tests.packs import counter_pack, faults_pack
from tests.remote.model_server import ModelServer as HostileModels
from tests.remote.served import serve
from tests.runner.conftest import NO_WAIT, admin_get, target, write_graders
from tests.runner.model_server import Call, ModelRequest, ModelServer, Reply
from tests.runner.test_loop import GRADERS, counter_line
from tests.system.helpers import clean_env

SPARRING = str(Path(sys.executable).with_name("sparring"))
LINE = {"messages": [{"role": "user", "content": "Say 103."}], "tools": [], "expected": "103"}


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileModels]:
    server = HostileModels()
    server.start()
    yield server
    server.stop()


def transcript() -> Transcript:
    line = DatasetLine.from_json(LINE)
    return Transcript(trace_id="trace_bounds", messages=line.messages, tools=[], item=line.item)


@pytest.mark.parametrize("api", APIS)
async def test_a_trickling_model_is_cut_at_the_turns_deadline(api: str, hostile: HostileModels) -> None:
    client = model_client("k", hostile.base_url())
    policy = make_policy(api, client, "trickle", deadline_s=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(ModelFailure, match=r"did not answer within 1 s"):
            await policy.next_turn(transcript())
    finally:
        await client.close()
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("name", ["huge", "huge-gzip"])
async def test_an_answer_past_the_cap_is_a_model_failure(api: str, name: str, hostile: HostileModels) -> None:
    client = model_client("k", hostile.base_url(), max_answer_bytes=64 * 1024)
    try:
        with pytest.raises(ModelFailure, match=f"over {64 * 1024} bytes") as failure:
            await make_policy(api, client, name).next_turn(transcript())
    finally:
        await client.close()
    assert failure.value.brief == f"the model's answer is over {64 * 1024} bytes"


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("name", ["garbage", "truncated", "keyed"])
async def test_an_answer_that_is_not_a_completion_is_a_model_failure(
    api: str, name: str, hostile: HostileModels
) -> None:
    client = model_client("k", hostile.base_url())
    try:
        with pytest.raises(ModelFailure, match="not a"):
            await make_policy(api, client, name).next_turn(transcript())
    finally:
        await client.close()


@pytest.mark.parametrize("api", APIS)
async def test_a_lone_surrogate_in_the_models_answer_is_graded_as_u_fffd(
    api: str, hostile: HostileModels, app_factory: AppFactory, tmp_path: Path
) -> None:
    """JSON can escape a lone surrogate, which no UTF-8 encoder writes back: the answer reaches the
    grader and the transcript with U+FFFD in its place, instead of failing the run."""
    client = model_client("k", hostile.base_url())
    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    try:
        async with app_factory(graders_file=graders) as app:
            t = target("says")
            result = await run_rollout(
                make_policy(api, client, "surrogate"),
                HttpToolCaller(app, t.tools, retry=NO_WAIT),
                counter_line(),
                grader=HttpGrader(app, t.grader, retry=NO_WAIT),
            )
            transcripts = t.transcripts(app, model="surrogate", source="eval")
            assert transcripts is not None
            await transcripts.store(result)
            stored = await admin_get(app, f"/rollouts/{result.trace_id}")
    finally:
        await client.close()
    assert result.discarded is None and result.final_text == "103 \ufffd"
    assert result.score == 1.0
    assert transcripts.failures == 0
    assert stored["transcript"]["messages"][-1]["content"] == "103 \ufffd"


async def test_eval_gives_up_on_a_trickling_model_at_its_model_timeout(
    hostile: HostileModels, tmp_path: Path, backend_settings: dict[str, Any]
) -> None:
    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    settings = make_settings(tmp_path / "server", graders_file=graders, **backend_settings)
    dataset = tmp_path / "one.jsonl"
    dataset.write_text(json.dumps(LINE) + "\n", encoding="utf-8")
    with serve(create_app(settings, packs=[counter_pack, faults_pack])) as url:
        started = time.monotonic()
        done = await asyncio.to_thread(
            subprocess.run,
            [
                SPARRING, "eval", "--dataset", str(dataset), "--model", "trickle", "--api", "chat",
                "--base-url", hostile.base_url(), "--server", url, "--grader", "says", "--samples", "1",
                "--model-timeout", "1", "--out", str(tmp_path / "report.json"),
            ],
            env=clean_env(
                SPARRING_TOOLS_KEY=TOOLS_KEY,
                SPARRING_GRADER_KEY=GRADER_KEY,
                SPARRING_HOME=str(tmp_path / "client-home"),
            ),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )  # fmt: skip
    # The pre-flight turn meets the same deadline: the run stops before any rollout, saying why.
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert time.monotonic() - started < 60
    assert (
        "the model failed its pre-flight call (trickle): the model did not answer within 1 s" in done.stderr
    )
    assert "--model-timeout sets the wait" in done.stderr
    assert not (tmp_path / "report.json").exists()


async def test_a_turn_of_countless_calls_sends_the_grader_only_the_calls_made(
    app_factory: AppFactory, tmp_path: Path, model_server: ModelServer, openai_client: AsyncOpenAI
) -> None:
    """100,000 calls in one turn: five are made (the cap), and the grade request carries those five."""

    def script(request: ModelRequest) -> Reply:
        return Reply(text="103", calls=tuple(Call("read_counter", {"name": None}) for _ in range(100_000)))

    model_server.script = script
    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    async with app_factory(graders_file=graders) as client:
        t = target("says")
        result = await run_rollout(
            make_policy("chat", openai_client, "scripted"),
            HttpToolCaller(client, t.tools, retry=NO_WAIT),
            counter_line(),
            grader=HttpGrader(client, t.grader, retry=NO_WAIT),
            limits=EpisodeLimits(max_turns=5, max_tool_calls=5),
        )
    assert result.discarded is None and result.ended_by == "max_tool_calls"
    assert result.sample is not None
    assert len(result.sample["choices"][0]["message"]["tool_calls"]) == 5
    assert len(result.sample["output_tools"]) == 5
    assert result.score == 1.0 and result.grade is not None and result.grade.attempts == 1


async def test_a_grade_request_refused_for_what_it_is_is_not_sent_again(
    app_factory: AppFactory, tmp_path: Path
) -> None:
    graders = write_graders(tmp_path / "graders.yaml", GRADERS)
    sample: dict[str, Any] = {"output_text": "x" * (2 * 1024 * 1024), "choices": []}
    async with app_factory(graders_file=graders) as client:
        grader = HttpGrader(client, target("says").grader, retry=NO_WAIT)
        too_large = await grader.grade(sample, {"expected": "x"}, "trace_too_large")
        # The grader reads item.expected: a row without it gets the same 422 however often it is sent.
        unusable = await grader.grade({"output_text": "x", "choices": []}, {}, "trace_no_expected")
    assert too_large.score is None and too_large.status == 413
    assert too_large.attempts == 1  # a 413 cannot pass on a second try
    assert unusable.score is None and unusable.status == 422 and unusable.attempts == 1
