"""The retail and airline packs enabled together: shared tool names are served at their packs' routes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.config import get_settings
from sparring.client import AsyncEnvironment
from sparring.http import Retry
from sparring.loop import DatasetLine
from sparring.session import RunOptions, TargetError, preflight, run_canaries, server_target
from tests.airline import corpus
from tests.conftest import ADMIN_KEY, AppFactory, new_trace
from tests.retail import corpus as retail_corpus
from tools import airline, retail
from tools.airline.dataset import build_dataset as build_airline_dataset

SHARED = {"calculate", "get_user_details", "transfer_to_human_agents"}


@pytest.fixture
def both(app_factory: AppFactory, airline_data: Path) -> Any:
    settings = {"retail": {"data": retail_corpus.fetch()}, "airline": {"data": airline_data}}
    return app_factory(packs=[retail.pack, airline.pack], key=ADMIN_KEY, pack_settings=settings)


async def call(
    client: httpx.AsyncClient, path: str, arguments: dict[str, Any], **body: Any
) -> httpx.Response:
    return await client.post(
        path, json={"call_id": "c1", "trace_id": new_trace(), "arguments": arguments, **body}
    )


def output(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    text: str = response.json()["output"]
    return text


async def test_a_shared_name_is_served_at_each_packs_route_only(both: Any) -> None:
    assert SHARED == set(retail.pack.tools) & set(airline.pack.tools)
    async with both as client:
        airline_user = output(
            await call(client, "/packs/airline/tools/get_user_details", {"user_id": "mei_hernandez_8984"})
        )
        retail_user = output(
            await call(client, "/packs/retail/tools/get_user_details", {"user_id": "yusuf_rossi_9620"})
        )
        by_body = output(
            await call(client, "/packs/airline/tools", {"expression": "2 + 2"}, name="calculate")
        )
        unqualified = output(await call(client, "/tools/calculate", {"expression": "2 + 2"}))
        unqualified_body = output(await call(client, "/tools", {"user_id": "x"}, name="get_user_details"))
        wrong_pack = output(await call(client, "/packs/retail/tools/get_flight_status", {}))
        unknown_pack = await call(client, "/packs/nope/tools/calculate", {"expression": "1"})
    assert json.loads(airline_user)["membership"] and "orders" in json.loads(retail_user)
    assert by_body == "4.0"
    assert unqualified == (
        "Error: the tool 'calculate' is served by several packs (retail, airline); call it at its pack's "
        "route: POST /packs/retail/tools/calculate or POST /packs/airline/tools/calculate"
    )
    assert "POST /packs/airline/tools/get_user_details" in unqualified_body
    assert (
        wrong_pack.startswith("Error: unknown tool 'get_flight_status'") and "get_order_details" in wrong_pack
    )
    assert unknown_pack.status_code == 404 and unknown_pack.json()["error"]["code"] == "not_found"


async def test_names_one_pack_has_keep_their_unqualified_route(both: Any) -> None:
    async with both as client:
        status = output(
            await call(client, "/tools/get_flight_status", {"flight_number": "HAT001", "date": "2024-05-01"})
        )
        listed = (await client.get("/tools")).json()
        airline_tools = (await client.get("/tools", params={"pack": "airline"})).json()
        no_pack = await client.get("/tools", params={"pack": "nope"})
    assert status == "landed"
    names = {tool["name"] for tool in listed}
    assert names == (set(retail.pack.tools) | set(airline.pack.tools)) - SHARED
    assert [tool["name"] for tool in airline_tools] == list(airline.pack.tools)
    assert {tool["pack"] for tool in airline_tools} == {"airline"}
    assert no_pack.status_code == 404


async def test_an_airline_rollout_on_the_qualified_routes_is_graded(both: Any) -> None:
    # Task 7 cancels reservations and states a refund: its gold calls, each at the airline's route.
    calls = corpus.gold_calls("7")
    trace = new_trace()
    async with both as client:
        for index, (name, arguments) in enumerate(calls):
            body = {"call_id": f"call_{index}", "trace_id": trace, "arguments": arguments}
            output(await client.post(f"/packs/airline/tools/{name}", json=body))
        graded = await client.post(
            "/grade/airline",
            json={
                "sample": {"output_text": corpus.answer_for("7")},
                "item": {"task_id": "7"},
                "trace_id": trace,
            },
        )
        state = (await client.get(f"/rollouts/{trace}/state")).json()
    assert graded.status_code == 200 and graded.json()["score"] == 1.0
    assert list(state["packs"]) == ["airline"]  # the calls changed the airline's database only
    assert state["packs"]["airline"]["changed"]["reservations"]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("SPARRING_PACKS", "retail,airline")
    for name in ("SPARRING_AUTH_HEADER", "SPARRING_GRADERS_FILE", "SPARRING_DEFAULT_GRADER"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def job_config(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        cli, ["job-config", "--base-url", "https://rft.example.com", "--grader", "airline", *args]
    )
    # The job on stdout; a refusal (and the legacy platform's warning) on stderr.
    return result.exit_code, result.stdout if result.exit_code == 0 else result.output


def test_job_config_takes_one_packs_tools_at_its_routes(env: None) -> None:
    code, text = job_config("--pack", "airline", "--platform", "openai")
    assert code == 0, text
    tools = json.loads(text)["tools"]
    assert [tool["name"] for tool in tools] == list(airline.pack.tools)
    assert {tool["server_url"] for tool in tools} == {
        f"https://rft.example.com/packs/airline/tools/{name}" for name in airline.pack.tools
    }
    # Without --pack, the job takes the grader's pack's tools, at that pack's routes.
    code, text = job_config("--platform", "openai")
    assert code == 0, text
    assert [tool["name"] for tool in json.loads(text)["tools"]] == list(airline.pack.tools)
    code, text = job_config("--pack", "nope", "--platform", "openai")
    assert code == 2 and "'nope' is not enabled" in text


def test_dataset_tools_and_the_tool_list_show_every_packs_tools(env: None) -> None:
    code = CliRunner().invoke(cli, ["dataset-tools"])
    assert code.exit_code == 2 and "pass --pack NAME" in code.output
    one = CliRunner().invoke(cli, ["dataset-tools", "--pack", "retail"])
    assert one.exit_code == 0, one.output
    assert [tool["function"]["name"] for tool in json.loads(one.output)] == list(retail.pack.tools)
    listed = CliRunner().invoke(cli, ["tools"])
    rows = [line.split()[:2] for line in listed.output.splitlines()[1:]]
    assert ["calculate", "retail"] in rows and ["calculate", "airline"] in rows


def _event_data(stream: str, event: str) -> str:
    """The data of the first `event:` of that name in an event stream (its `data:` lines joined)."""
    for block in stream.replace("\r\n", "\n").split("\n\n"):
        lines = block.split("\n")
        if f"event: {event}" in lines:
            return "\n".join(
                line.removeprefix("data:").removeprefix(" ") for line in lines if line.startswith("data:")
            )
    raise AssertionError(f"no {event!r} event in {stream!r}")


async def test_an_episode_of_one_pack_lists_and_calls_its_shared_names(both: Any) -> None:
    """An ORS episode on airline, with retail enabled too: the shared names are airline's tools there."""
    key = {"X-API-Key": ADMIN_KEY}
    async with both as client:
        listed = (await client.get("/airline/tools", headers=key)).json()["tools"]
        sid = _event_data((await client.post("/create_session", headers=key)).text, "task_id")
        created = await client.post(
            "/create",
            json={"env_name": "airline", "split": "test", "index": 0},
            headers={**key, "X-Session-ID": sid},
        )
        assert created.status_code == 200, created.text
        called = await client.post(
            "/airline/call",
            json={"name": "get_user_details", "input": {"user_id": "mei_hernandez_8984"}},
            headers={**key, "X-Session-ID": sid},
        )
    names = [tool["name"] for tool in listed]
    assert SHARED <= set(names) and names == list(airline.pack.tools)
    end = json.loads(_event_data(called.text, "end"))
    assert end["ok"] is True, end
    user = json.loads(end["output"]["blocks"][0]["text"])
    assert user["user_id"] == "mei_hernandez_8984" and "membership" in user


async def test_the_client_lists_and_calls_one_packs_shared_names(both: Any) -> None:
    """`sparring.client` on a retail+airline server: a pack's tools include the names it shares, and
    its calls go to its pack's routes."""
    async with both as client:
        plain = AsyncEnvironment("http://sparring", http=client)
        retail_listed = [tool["function"]["name"] for tool in await plain.tools(pack="retail")]
        assert retail_listed == list(retail.pack.tools)
        env = AsyncEnvironment("http://sparring", http=client, pack="airline")
        listed = [tool["function"]["name"] for tool in await env.tools()]
        async with env.rollout() as rollout:
            user = await rollout.call("get_user_details", {"user_id": "mei_hernandez_8984"})
            total = await rollout.call("calculate", {"expression": "2 + 2"})
        retail_user = await env.rollout(pack="retail").call(
            "get_user_details", {"user_id": "yusuf_rossi_9620"}
        )
        unqualified = await plain.rollout().call("calculate", {"expression": "2 + 2"})
    assert listed == list(airline.pack.tools)
    assert json.loads(user)["membership"] and total == "4.0"
    assert "orders" in json.loads(retail_user)
    assert unqualified.startswith("Error: the tool 'calculate' is served by several packs")


async def test_an_eval_of_one_pack_calls_its_shared_names_at_its_routes(both: Any) -> None:
    """`sparring eval --server --pack airline` on a retail+airline server: the preflight finds every tool
    of the lines served, and the gold calls of `get_user_details` are airline's, not an error."""
    line = next(row for row in build_airline_dataset(corpus.fetch(), "test") if row["task_id"] == "2")
    lines = [DatasetLine.from_json(line)]
    assert "get_user_details" in [action["name"] for action in line["actions"]]
    options = RunOptions(run="airline-gold", retry=Retry(attempts=1))
    async with both as client:
        unqualified = server_target("http://sparring", tools_key=None, grader_key=None, grader="airline")
        warned = await preflight(client, unqualified, lines)
        target = server_target(
            "http://sparring", tools_key=None, grader_key=None, grader="airline", pack="airline"
        )
        assert await preflight(client, target, lines) == []
        report = await run_canaries(client, target, lines, options, policies=["gold"])
        trace = report["rollouts"][0]["trace_id"]
        timeline = (await client.get(f"/rollouts/{trace}")).json()["timeline"]
        missing = server_target(
            "http://sparring", tools_key=None, grader_key=None, grader="airline", pack="nope"
        )
        with pytest.raises(TargetError, match="no enabled pack named 'nope'"):
            await preflight(client, missing, lines)
    assert any("get_user_details" in w and "--pack" in w for w in warned)
    assert report["rollouts"][0]["score"] == 1.0
    assert [call["tool"] for call in timeline] == [action["name"] for action in line["actions"]]
    assert {call["outcome"] for call in timeline} == {"ok"}
