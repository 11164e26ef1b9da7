"""The telecom pack served: the phone's tools at /user-tools (never offered to the agent), one state per
rollout, the task's initialization on the first call that names it, exactly-once retries, the user's
calls in the rollout's log on the channel `user`, the grader's errors."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from app.deps import app_state
from tests.conftest import ADMIN_KEY, AppFactory, new_trace
from tests.telecom import corpus
from tools.telecom import pack

TASK = "[mobile_data_issue]user_abroad_roaming_enabled_off[PERSONA:None]"


@pytest.fixture
async def client(app_factory: AppFactory, telecom_data: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"telecom": {"data": telecom_data}}
    ) as served:
        yield served


async def call(
    client: httpx.AsyncClient,
    route: str,
    trace: str,
    arguments: dict[str, Any] | None = None,
    *,
    call_id: str | None = None,
    task: str | None = TASK,
) -> str:
    body = {
        "call_id": call_id,
        "arguments": orjson.dumps(arguments or {}).decode(),
        "trace_id": trace,
        "item": {"task_id": task} if task else {},
    }
    response = await client.post(route, json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["output"])


async def test_the_agent_is_never_offered_the_phones_tools(client: httpx.AsyncClient) -> None:
    agent = [tool["name"] for tool in (await client.get("/tools")).json()]
    assert agent == list(pack.tools) and len(agent) == 13
    assert [tool["name"] for tool in (await client.get("/tools?pack=telecom")).json()] == agent
    registry = app_state(client.app).registry  # type: ignore[attr-defined]
    assert [tool["function"]["name"] for tool in registry.dataset_tools("telecom")] == agent
    listed = (await client.get("/user-tools")).json()
    assert [tool["name"] for tool in listed] == list(pack.user_tools) and len(listed) == 30
    assert (await client.get("/user-tools?pack=telecom")).json() == listed
    assert not set(agent) & {tool["name"] for tool in listed}
    by_name = {tool["name"]: tool for tool in listed}
    assert by_name["grant_app_permission"]["parameters"]["required"] == ["app_name", "permission"]
    assert (await client.get("/user-tools?pack=nope")).status_code == 404
    mcp_headers = {
        "Host": "127.0.0.1",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2025-11-25",
        "Authorization": f"Bearer {ADMIN_KEY}",
    }
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    mcp = await client.post("/mcp", json=listing, headers=mcp_headers)
    assert mcp.status_code == 200, mcp.text
    assert [tool["name"] for tool in mcp.json()["result"]["tools"]] == agent


async def test_each_side_calls_only_its_own_tools(client: httpx.AsyncClient) -> None:
    trace = new_trace()
    wrong = await call(client, "/tools/toggle_airplane_mode", trace)
    assert wrong.startswith("Error: unknown tool 'toggle_airplane_mode'")
    wrong = await call(client, "/user-tools/refuel_data", trace)
    assert wrong.startswith("Error: unknown tool 'refuel_data'")
    qualified = await call(client, "/packs/telecom/user-tools/check_sim_status", trace)
    assert qualified == "Your SIM card is active and working."


async def test_the_tasks_initialization_applies_on_the_first_call_that_names_it(
    client: httpx.AsyncClient,
) -> None:
    plain, tasked = new_trace(), new_trace()
    assert "Data Roaming Enabled: No" in await call(
        client, "/user-tools/check_network_status", plain, task=None
    )
    # The task: abroad, the phone's roaming off, the line's roaming on at the carrier (synced to the phone).
    assert (await call(client, "/user-tools/run_speed_test", tasked)) == "Speed test failed: No Connection."
    usage = json.loads(
        await call(client, "/tools/get_data_usage", tasked, {"customer_id": "C1001", "line_id": "L1002"})
    )
    assert usage["data_used_gb"] == "8.7"  # a string, as τ²-bench writes it
    assert (await call(client, "/user-tools/toggle_roaming", tasked)).startswith("Data Roaming is now ON.")
    assert (await call(client, "/user-tools/run_speed_test", tasked)).startswith(
        "Speed Test Result: 275.00 Mbps (Excellent)"
    )
    # The carrier's side acts on the phone at once (the sync after every call).
    await call(client, "/tools/disable_roaming", tasked, {"customer_id": "C1001", "line_id": "L1002"})
    assert (await call(client, "/user-tools/run_speed_test", tasked)) == "Speed test failed: No Connection."
    # The other rollout is untouched by all of it.
    assert "Data Roaming Enabled: No" in await call(
        client, "/user-tools/check_network_status", plain, task=None
    )


async def test_rollouts_are_isolated(client: httpx.AsyncClient) -> None:
    one, two = new_trace(), new_trace()
    assert (await call(client, "/user-tools/toggle_airplane_mode", one)).startswith(
        "Airplane Mode is now ON."
    )
    assert "Airplane Mode: OFF" in await call(client, "/user-tools/check_network_status", two)
    assert "Airplane Mode: ON" in await call(client, "/user-tools/check_network_status", one)
    await call(
        client, "/tools/refuel_data", one, {"customer_id": "C1001", "line_id": "L1002", "gb_amount": 2.0}
    )
    arguments = {"customer_id": "C1001", "line_id": "L1002"}
    assert (
        json.loads(await call(client, "/tools/get_data_usage", one, arguments))["data_refueling_gb"] == "2.0"
    )
    assert (
        json.loads(await call(client, "/tools/get_data_usage", two, arguments))["data_refueling_gb"] == "0.0"
    )


async def test_a_refuel_too_large_to_keep_is_an_error_on_every_backend(client: httpx.AsyncClient) -> None:
    # 1e308 GB at $2.0/GB costs more than a float holds: a rollout's state (JSON) has no infinity.
    trace = new_trace()
    line = {"customer_id": "C1001", "line_id": "L1002"}
    huge = await call(client, "/tools/refuel_data", trace, {**line, "gb_amount": 1e308})
    assert huge == "Error: Refuel amount is too large"
    refuel = json.loads(await call(client, "/tools/refuel_data", trace, {**line, "gb_amount": 2.0}))
    assert refuel["new_data_refueling_gb"] == "2.0" and refuel["charge"] == "4.0"
    bills = json.loads(await call(client, "/tools/get_bills_for_customer", trace, {"customer_id": "C1001"}))
    assert [bill["total_due"] for bill in bills if bill["status"] == "Draft"] == [4.0]
    # Each charge fits, their sum on the bill does not.
    assert "Error" not in await call(client, "/tools/refuel_data", trace, {**line, "gb_amount": 8e307})
    again = await call(client, "/tools/refuel_data", trace, {**line, "gb_amount": 8e307})
    assert again == "Error: Refuel amount is too large"


async def test_a_retried_call_replays_its_answer_without_running_again(client: httpx.AsyncClient) -> None:
    trace = new_trace()
    first = await call(client, "/user-tools/toggle_airplane_mode", trace, call_id="c1")
    again = await call(client, "/user-tools/toggle_airplane_mode", trace, call_id="c1")
    assert first == again and first.startswith("Airplane Mode is now ON.")
    assert "Airplane Mode: ON" in await call(client, "/user-tools/check_network_status", trace, call_id="c2")
    reused = await call(client, "/user-tools/toggle_data", trace, call_id="c1")
    assert reused.startswith("Error: call_id 'c1' was already used for a different call")


async def test_the_simulators_entry_logs_the_users_calls_in_the_rollout(client: httpx.AsyncClient) -> None:
    service = app_state(client.app).call_service  # type: ignore[attr-defined]
    trace = new_trace()
    answered = await service.call_user_tool(
        "telecom", "toggle_data", {}, trace_id=trace, call_id="u1", item={"task_id": TASK}
    )
    assert answered.outcome == "ok" and answered.output.output.startswith("Mobile Data is now OFF.")
    again = await service.call_user_tool(
        pack, "toggle_data", {}, trace_id=trace, call_id="u1", item={"task_id": TASK}
    )
    assert again.output.output == answered.output.output
    await call(client, "/tools/get_customer_by_id", trace, {"customer_id": "C1001"}, call_id="a1")
    detail = (await client.get(f"/review/api/rollouts/{trace}")).json()
    assert [(c["tool"], c["channel"]) for c in detail["timeline"]] == [
        ("toggle_data", "user"),
        ("get_customer_by_id", "rft"),
    ]


async def test_the_scenario_of_a_row_is_the_tasks_user_scenario(client: httpx.AsyncClient) -> None:
    served = app_state(client.app).registry.packs["telecom"]  # type: ignore[attr-defined]
    assert served.scenario_loader is not None
    spec = served.scenario_loader(served.resources, {"task_id": TASK})
    # A row's `user_simulator`: the task's scenario, τ²'s guidelines (both variants), the phone's tools.
    assert spec["scenario"] == corpus.get_task(TASK).user_scenario.model_dump(mode="json")
    assert "John Smith" in spec["scenario"]["instructions"]["known_info"]
    assert spec["guidelines"].startswith("# User Simulation Guidelines")
    assert spec["guidelines_tools"] != spec["guidelines"]
    assert [tool["function"]["name"] for tool in spec["tools"]] == list(served.user_tools)
    assert served.scenario_loader(served.resources, {"task_id": "nope"}) is None


async def test_the_grader_names_a_row_it_cannot_grade(client: httpx.AsyncClient) -> None:
    trace = new_trace()
    await call(client, "/user-tools/check_sim_status", trace)
    for item in ({}, {"task_id": "nope"}):
        graded = await client.post("/grade/telecom", json={"sample": {}, "item": item, "trace_id": trace})
        assert graded.status_code == 422, graded.text
        assert "task" in graded.json()["error"]["message"]


async def test_a_rollout_that_never_called_is_graded_on_the_tasks_initial_state(
    client: httpx.AsyncClient,
) -> None:
    # The task's problem is still there: τ²-bench's reward is 0 (and a task whose fix is nothing would be 1).
    graded = await client.post(
        "/grade/telecom", json={"sample": {}, "item": {"task_id": TASK}, "trace_id": new_trace()}
    )
    assert graded.status_code == 200, graded.text
    assert graded.json()["score"] == 0.0


@pytest.mark.parametrize("ended_by", ["max_steps", "too_many_errors", "user_stop", "user_out_of_scope"])
async def test_a_conversation_cut_short_scores_0_with_a_stored_flag(
    client: httpx.AsyncClient, ended_by: str
) -> None:
    # τ²-bench's evaluate_simulation rewards a simulation that ended by MAX_STEPS or TOO_MANY_ERRORS 0
    # ("terminated prematurely"), the fix made or not; the user's stop tokens are its USER_STOP, graded.
    trace = new_trace()
    for index, (requestor, name, arguments) in enumerate(corpus.gold_calls(TASK)):
        route = f"/user-tools/{name}" if requestor == "user" else f"/tools/{name}"
        await call(client, route, trace, arguments, call_id=f"call_{index}")
    sample = {"output_text": "Done.", "ended_by": ended_by}
    graded = await client.post(
        "/grade/telecom", json={"sample": sample, "item": {"task_id": TASK}, "trace_id": trace}
    )
    assert graded.status_code == 200, graded.text
    premature = ended_by in ("max_steps", "too_many_errors")
    assert graded.json()["score"] == (0.0 if premature else 1.0)
    timeline = await client.get(f"/review/api/rollouts/{trace}")
    assert timeline.status_code == 200, timeline.text
    (grade,) = timeline.json()["grades"]
    flags = {flag["name"]: flag["reason"] for flag in grade["flags"]}
    assert ("premature_end" in flags) == premature
    assert not premature or ended_by in flags["premature_end"]
