"""retail, airline and telecom enabled together: the shared name `transfer_to_human_agents` at each pack's
route, the phone's tools at /user-tools, telecom's own tools in a job, an episode's list and MCP."""

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
from app.deps import app_state
from app.users.service import with_service_tools
from sparring.usersim import SCENARIO_KEY, SimulatedUser
from tests.airline import corpus as airline_corpus
from tests.conftest import ADMIN_KEY, AppFactory, new_trace
from tests.retail import corpus as retail_corpus
from tools import airline, retail, telecom
from tools.airline.dataset import build_dataset as build_airline_dataset

TASK = "[mobile_data_issue]user_abroad_roaming_enabled_off[PERSONA:None]"


@pytest.fixture
def three(app_factory: AppFactory, telecom_data: Path) -> Any:
    settings = {
        "retail": {"data": retail_corpus.fetch()},
        "airline": {"data": airline_corpus.fetch()},
        "telecom": {"data": telecom_data},
    }
    packs = [retail.pack, airline.pack, telecom.pack]
    return app_factory(packs=packs, key=ADMIN_KEY, pack_settings=settings)


async def call(client: httpx.AsyncClient, path: str, trace: str, arguments: dict[str, Any]) -> str:
    body = {"trace_id": trace, "arguments": arguments, "item": {"task_id": TASK}}
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["output"])


async def test_the_three_packs_side_by_side(three: Any) -> None:
    assert {"transfer_to_human_agents"} <= set(telecom.pack.tools) & set(retail.pack.tools)
    trace = new_trace()
    async with three as client:
        summary = {"summary": "the customer asked for a person"}
        qualified = await call(client, "/packs/telecom/tools/transfer_to_human_agents", trace, summary)
        unqualified = await call(client, "/tools/transfer_to_human_agents", trace, summary)
        own = await call(client, "/tools/get_customer_by_id", trace, {"customer_id": "C1001"})
        phone = await call(client, "/user-tools/toggle_roaming", trace, {})
        speed = await call(client, "/packs/telecom/user-tools/run_speed_test", trace, {})
        episode = (await client.get("/telecom/tools", headers={"X-API-Key": ADMIN_KEY})).json()["tools"]
        graded = await client.post(
            "/grade/telecom", json={"sample": {}, "item": {"task_id": TASK}, "trace_id": trace}
        )
        state = (await client.get(f"/rollouts/{trace}/state")).json()
    assert qualified == "Transfer successful"
    assert unqualified.startswith("Error: the tool 'transfer_to_human_agents' is served by several packs")
    assert "POST /packs/telecom/tools/transfer_to_human_agents" in unqualified
    assert json.loads(own)["full_name"] == "John Smith"
    assert phone.startswith("Data Roaming is now ON.") and speed.startswith("Speed Test Result: 275.00 Mbps")
    assert [tool["name"] for tool in episode] == list(telecom.pack.tools)
    assert graded.status_code == 200 and graded.json()["score"] == 1.0
    assert list(state["packs"]) == ["telecom"]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("SPARRING_PACKS", "retail,airline,telecom")
    for name in ("SPARRING_AUTH_HEADER", "SPARRING_GRADERS_FILE", "SPARRING_DEFAULT_GRADER"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_a_telecom_job_lists_the_agents_tools_at_their_packs_routes(env: None) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "job-config",
            "--base-url",
            "https://rft.example.com",
            "--grader",
            "telecom",
            "--pack",
            "telecom",
            "--platform",
            "openai",
        ],
    )
    assert result.exit_code == 0, result.output
    tools = json.loads(result.stdout)["tools"]
    assert [tool["name"] for tool in tools] == list(telecom.pack.tools)
    assert {tool["server_url"] for tool in tools} == {
        f"https://rft.example.com/packs/telecom/tools/{name}" for name in telecom.pack.tools
    }


async def test_an_airline_customer_played_beside_the_phone_has_no_tools(three: Any) -> None:
    """τ²-bench's airline user has no tools: a rollout that names no pack (a remote rollout may not) must
    not offer an airline customer the phone of the telecom pack served beside it."""
    line = build_airline_dataset(airline_corpus.fetch(), "test")[0]
    async with three as client:
        services = app_state(client.app)
        user = SimulatedUser(model=None, name="user")  # type: ignore[arg-type]  # never asked
        served = with_service_tools(user, services.call_service, pack=None, run=None)
        assert served is not None
        conversation = served.start(line[SCENARIO_KEY], {"task_id": line["task_id"]}, new_trace())
    assert conversation is not None and conversation.schemas == []
    assert conversation.prompt.startswith(line[SCENARIO_KEY]["guidelines"])
