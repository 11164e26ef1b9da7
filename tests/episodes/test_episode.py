"""A step and a submit: the call service's answers on the session's rollout, the pack grader's reward."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from app.deps import AppState, app_state
from app.episodes.episode import EpisodeFinished, call_tool, session_store, submit, tool_specs
from app.episodes.sessions import EpisodeSession
from app.episodes.tasks import load_task_rows
from tests.conftest import ADMIN_KEY, GRADER_KEY, AppFactory, new_trace
from tests.episodes.conftest import gold_answer
from tests.packs import counter_pack
from tools.retail.tasks import calls_from_actions


def state_of(client: httpx.AsyncClient) -> AppState:
    return app_state(client.app)  # type: ignore[attr-defined]


async def write_task(client: httpx.AsyncClient) -> dict[str, Any]:
    """The first test task whose gold calls change the database (a wrong episode cannot pass it)."""
    registry = state_of(client).registry
    for row in await load_task_rows(registry, "retail", "test"):
        if any(registry.tools[a["name"]].mutates for a in row["actions"]):
            return row
    raise AssertionError("no test task writes")


async def open_session(client: httpx.AsyncClient, row: dict[str, Any]) -> EpisodeSession:
    made = await session_store(state_of(client)).create(
        pack="retail", trace_id=f"trace_ors_{uuid.uuid4()}", row=row, channel="ors", run="episode-test"
    )
    assert made is not None
    return made


async def replayed_on_a_fresh_trace(client: httpx.AsyncClient, calls: list[tuple[str, Any]]) -> list[str]:
    trace = new_trace()
    outputs = []
    for number, (name, arguments) in enumerate(calls):
        answer = await client.post(
            f"/tools/{name}",
            json={
                "type": "function_call",
                "call_id": f"c{number}",
                "arguments": arguments,
                "trace_id": trace,
            },
        )
        assert answer.status_code == 200, answer.text
        outputs.append(answer.json()["output"])
    return outputs


async def graded_over_http(client: httpx.AsyncClient, trace: str, row: dict[str, Any], answer: str) -> float:
    graded = await client.post(
        "/grade/retail",
        json={"sample": {"output_text": answer}, "item": row, "trace_id": trace},
        headers={"Authorization": f"Bearer {GRADER_KEY}"},
    )
    assert graded.status_code == 200, graded.text
    score: float = graded.json()["score"]
    return score


async def test_gold_steps_answer_as_the_tool_routes_and_submit_scores_one(retail: httpx.AsyncClient) -> None:
    services = state_of(retail)
    row = await write_task(retail)
    calls: list[tuple[str, Any]] = list(calls_from_actions(row["actions"]))
    first_tool = calls[0][0]
    calls.insert(1, (first_tool, {"no_such_argument": 1}))  # a model mistake among the gold calls
    session = await open_session(retail, row)

    steps = [
        await call_tool(services, session, name, args, f"call_{n}") for n, (name, args) in enumerate(calls)
    ]
    assert [s.output for s in steps] == await replayed_on_a_fresh_trace(retail, calls)
    assert [s.is_error for s in steps] == [n == 1 for n in range(len(calls))]
    assert steps[1].output.startswith("Error: ") and steps[1].outcome == "model_error"
    assert session.step_count == len(calls)

    answer = gold_answer(row)
    reward = await submit(services, session, answer)
    assert reward == 1.0
    assert reward == await graded_over_http(retail, session.trace_id, row, answer)
    stored = await session_store(services).get(session.sid)
    assert stored is not None and stored.done and stored.reward == 1.0

    with pytest.raises(EpisodeFinished):
        await call_tool(services, stored, first_tool, calls[0][1], "call_after")
    with pytest.raises(EpisodeFinished):
        await submit(services, stored, answer)

    logged = await retail.get(
        f"/rollouts/{session.trace_id}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    timeline = logged.json()["timeline"]
    assert [c["tool"] for c in timeline] == [name for name, _ in calls]
    assert {c["channel"] for c in timeline} == {"ors"} and logged.json()["run"] == "episode-test"


async def test_a_lookup_and_a_wrong_answer_score_zero(retail: httpx.AsyncClient) -> None:
    services = state_of(retail)
    row = await write_task(retail)
    session = await open_session(retail, row)
    await call_tool(services, session, "list_all_product_types", {}, "call_0")
    reward = await submit(services, session, "I could not help, sorry.")
    assert reward == 0.0
    assert reward == await graded_over_http(retail, session.trace_id, row, "I could not help, sorry.")


async def test_a_retried_step_is_replayed_not_run_again(retail: httpx.AsyncClient) -> None:
    services = state_of(retail)
    row = await write_task(retail)
    session = await open_session(retail, row)
    name, arguments = calls_from_actions(row["actions"])[0]
    first = await call_tool(services, session, name, arguments, "call_same")
    again = await call_tool(services, session, name, arguments, "call_same")
    assert again.output == first.output
    logged = await retail.get(
        f"/rollouts/{session.trace_id}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert [c["outcome"] for c in logged.json()["timeline"]].count("ok") == 1


async def test_tool_specs_are_the_packs_tools_as_get_tools_lists_them(retail: httpx.AsyncClient) -> None:
    listed = (await retail.get("/tools")).json()
    specs = tool_specs(state_of(retail).registry, "retail")
    assert specs == [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in listed
    ]
    assert all(set(s) == {"name", "description", "input_schema"} for s in specs)
    assert "submit" not in {s["name"] for s in specs}


async def test_without_a_grader_submit_ends_the_episode_without_a_reward(app_factory: AppFactory) -> None:
    async with app_factory(packs=[counter_pack]) as client:
        services = state_of(client)
        session = await session_store(services).create(
            pack="counter", trace_id=new_trace(), row={"task_id": "c"}, channel="openenv", run="r"
        )
        assert session is not None
        step = await call_tool(services, session, "increment", {"by": 2}, "call_1")
        assert step.output == '{"value":102}' and not step.is_error
        assert await submit(services, session, "done", call_id="call_2") is None
        assert await submit(services, session, "done", call_id="call_2") is None  # its retry: replayed
        with pytest.raises(EpisodeFinished):
            await submit(services, session, "done", call_id="call_3")
        stored = await session_store(services).get(session.sid)
        assert stored is not None and stored.done and stored.reward is None and stored.step_count == 1
