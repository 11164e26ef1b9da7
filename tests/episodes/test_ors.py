"""The ORS front door at the origin root, driven by the real, unmodified ors-sdk client (both backends).

Acceptance 1-7 of the episode protocols, ORS side: the key, the Task API, the tools and the terminal
tool, outputs equal to the tool routes', one session = one rollout, submit's reward, and what happens
after submit and on a retry.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from ors.client import AsyncORS
from ors.client._types import AuthenticationError, Task, ToolCallError

from app.episodes import ors as ors_module
from app.main import create_app
from tests.conftest import ADMIN_KEY, GRADER_KEY, REDIS_URL, TOOLS_KEY, AppFactory, make_settings, new_trace
from tests.episodes.conftest import gold_answer
from tests.faults import DroppingProxy
from tests.packs import faults_pack
from tests.remote.served import serve
from tools.retail import pack as retail_pack
from tools.retail.tasks import calls_from_actions

Rows = list[dict[str, Any]]
REDIS_PORT = int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])


@pytest.fixture
def url(tmp_path: Path, backend_settings: dict[str, Any], retail_data: Path) -> Iterator[str]:
    """A served app with the retail pack (which ships tasks) and the faults pack (which does not)."""
    settings = make_settings(tmp_path / "home", **backend_settings)
    app = create_app(
        settings, packs=[retail_pack, faults_pack], pack_settings={"retail": {"data": retail_data}}
    )
    with serve(app) as base:
        yield base


def events(text: str) -> list[tuple[str, str]]:
    """(event, data) of a server-sent event stream; comments (`: ping`) as ("", comment)."""
    found: list[tuple[str, str]] = []
    for frame in text.split("\n\n"):
        if frame.startswith(":"):
            found.append(("", frame))
            continue
        fields = dict(
            line.split(": ", 1) if ": " in line else (line.rstrip(":"), "") for line in frame.splitlines()
        )
        if "event" in fields:
            found.append((fields["event"], fields.get("data", "")))
    return found


async def replayed_on_a_fresh_trace(http: httpx.AsyncClient, calls: list[tuple[str, Any]]) -> list[str]:
    trace, outputs = new_trace(), []
    for number, (name, arguments) in enumerate(calls):
        answer = await http.post(
            f"/tools/{name}",
            json={"call_id": f"c{number}", "arguments": arguments, "trace_id": trace},
            headers={"Authorization": f"Bearer {TOOLS_KEY}"},
        )
        assert answer.status_code == 200, answer.text
        outputs.append(answer.json()["output"])
    return outputs


async def graded(http: httpx.AsyncClient, trace: str, row: dict[str, Any], answer: str) -> float:
    response = await http.post(
        "/grade/retail",
        json={"sample": {"output_text": answer}, "item": row, "trace_id": trace},
        headers={"Authorization": f"Bearer {GRADER_KEY}"},
    )
    assert response.status_code == 200, response.text
    score: float = response.json()["score"]
    return score


async def rollout(http: httpx.AsyncClient, trace: str) -> dict[str, Any]:
    response = await http.get(f"/rollouts/{trace}", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status_code == 200, response.text
    detail: dict[str, Any] = response.json()
    return detail


def first_writing_task(rows: Rows) -> tuple[int, dict[str, Any]]:
    for index, row in enumerate(rows):
        if any(retail_pack.tools[a["name"]].mutates for a in row["actions"]):
            return index, row
    raise AssertionError("no test task writes")


# ---- 1. the key --------------------------------------------------------------------------------------


async def test_the_tools_key_in_x_api_key_opens_ors_and_nothing_else_does(
    url: str, http: httpx.AsyncClient
) -> None:
    for headers in (
        {},
        {"X-API-Key": "wrong"},
        {"X-API-Key": GRADER_KEY},
        {"Authorization": f"Bearer {TOOLS_KEY}"},
    ):
        for method, path in (
            ("POST", "/create_session"),
            ("GET", "/retail/tools"),
            ("POST", "/retail/tasks"),
        ):
            refused = await http.request(
                method, path, headers={"X-API-Key": "", **headers}, json={"split": "test"}
            )
            assert refused.status_code == 401, (headers, path, refused.text)
    assert (await http.get("/list_environments")).status_code == 200
    for key in (None, "wrong"):
        client = AsyncORS(base_url=url, api_key=key)
        env = client.environments.get("retail")
        with pytest.raises(AuthenticationError):
            await env.list_tools()
        with pytest.raises(AuthenticationError):
            async with env.session(split="test", index=0):
                pass
        await env.client.close()


# ---- 2. the Task API ---------------------------------------------------------------------------------


async def test_the_task_api_serves_the_dataset_build_rows(
    ors: AsyncORS, http: httpx.AsyncClient, built_test_split: Rows
) -> None:
    env = ors.environments.get("retail")
    assert await env.list_splits() == ["train", "test"]
    tasks = await env.list_tasks("test")
    assert [t.task_spec for t in tasks] == built_test_split
    assert {t.environment_name for t in tasks} == {"retail"}
    assert await env.num_tasks("test") == len(built_test_split) == 40
    assert (await env.get_task("test", 7)).task_spec == built_test_split[7]
    assert [t.task_spec for t in await env.get_task_range("test", 3, 6)] == built_test_split[3:6]
    assert [t.task_spec for t in await env.get_task_range("test", -2)] == built_test_split[-2:]
    assert [t.task_spec for t in await env.get_task_range("test", stop=2)] == built_test_split[:2]

    assert (await http.get("/list_environments")).json() == ["retail", "faults"]
    task = await http.post("/retail/task", json={"split": "test", "index": 7})
    assert task.json() == {"task": built_test_split[7], "env_name": "retail"}
    bad_split = await http.post("/retail/tasks", json={"split": "dev"})
    assert (bad_split.status_code, bad_split.json()) == (400, {"detail": "Invalid split"})
    bad_index = await http.post("/retail/task", json={"split": "test", "index": 40})
    assert (bad_index.status_code, bad_index.json()) == (400, {"detail": "Invalid index"})
    assert (await http.post("/airline/tasks", json={"split": "test"})).status_code == 404
    assert (await http.get("/faults/splits")).json() == []


# ---- 3. the tools and the terminal tool --------------------------------------------------------------


async def test_tools_are_the_packs_and_submit_is_the_terminal_tool(
    ors: AsyncORS, http: httpx.AsyncClient
) -> None:
    served = (await http.get("/tools", headers={"Authorization": f"Bearer {TOOLS_KEY}"})).json()
    expected = [(t["name"], t["description"], t["parameters"]) for t in served if t["pack"] == "retail"]
    env = ors.environments.get("retail")
    assert [(t.name, t.description, t.input_schema) for t in await env.list_tools()] == expected
    async with env.session(split="test", index=0) as session:
        assert [(t.name, t.description, t.input_schema) for t in await session.list_tools()] == expected
    listed = (await http.get("/retail/tools")).json()
    assert listed["terminal_tool"]["name"] == "submit" and listed["terminal_tool"]["arg"] == "answer"
    assert "submit" not in {t["name"] for t in listed["tools"]}
    assert all(set(tool) == {"name", "description", "input_schema"} for tool in listed["tools"])
    assert (await http.get("/retail/task_tools")).json() == listed


# ---- 4-7. an episode ---------------------------------------------------------------------------------


async def test_an_episode_answers_as_the_tool_routes_logs_one_rollout_and_submit_grades(
    ors: AsyncORS, http: httpx.AsyncClient, built_test_split: Rows
) -> None:
    index, row = first_writing_task(built_test_split)
    calls: list[tuple[str, Any]] = list(calls_from_actions(row["actions"]))
    calls.insert(1, (calls[0][0], {"no_such_argument": 1}))  # one model mistake among the gold calls
    env = ors.environments.get("retail")
    async with env.session(split="test", index=index) as session:
        prompt = await session.get_prompt()
        assert [(b.text, b.detail) for b in prompt] == [
            (m["content"], {"role": m["role"]}) for m in row["messages"]
        ]
        outputs = [await session.call_tool(name, arguments) for name, arguments in calls]
        answer = gold_answer(row)
        ended = await session.call_tool("submit", {"answer": answer})
        with pytest.raises(ToolCallError, match=r"^episode_finished"):
            await session.call_tool(calls[0][0], calls[0][1])
        with pytest.raises(ToolCallError, match=r"^episode_finished"):
            await session.call_tool("submit", {"answer": answer})

    assert [o.blocks[0].text for o in outputs] == await replayed_on_a_fresh_trace(http, calls)
    assert [o.metadata["is_error"] for o in outputs] == [n == 1 for n in range(len(calls))]  # type: ignore[index]
    assert all(not o.finished and o.reward is None for o in outputs)
    trace = outputs[0].metadata["trace_id"]  # type: ignore[index]
    assert {o.metadata["trace_id"] for o in outputs} == {trace}  # type: ignore[index]
    assert trace.startswith(f"trace_ors_{session.sid}_")  # a fresh rollout, named after the session

    assert ended.finished is True and ended.reward == 1.0
    assert ended.reward == await graded(http, trace, row, answer)
    logged = await rollout(http, trace)
    assert [c["tool"] for c in logged["timeline"]] == [name for name, _ in calls]
    assert {c["channel"] for c in logged["timeline"]} == {"ors"} and logged["run"] == "ors"
    assert logged["item_key"] == f"task_id:{row['task_id']}"


async def test_a_lookup_and_a_wrong_answer_score_zero_and_sessions_never_share_a_trace(
    ors: AsyncORS, http: httpx.AsyncClient, built_test_split: Rows
) -> None:
    index, row = first_writing_task(built_test_split)
    env = ors.environments.get("retail")
    async with env.session(task=Task(environment_name="retail", task_spec=row)) as first:
        async with env.session(split="test", index=index) as second:
            looked = await first.call_tool("list_all_product_types", {})
            other = await second.call_tool("list_all_product_types", {})
            ended = await first.call_tool("submit", {"answer": "Sorry, I could not help."})
    trace = looked.metadata["trace_id"]  # type: ignore[index]
    assert trace != other.metadata["trace_id"]  # type: ignore[index]
    assert ended.finished is True and ended.reward == 0.0
    assert ended.reward == await graded(http, trace, row, "Sorry, I could not help.")
    assert [c["tool"] for c in (await rollout(http, trace))["timeline"]] == ["list_all_product_types"]


async def test_a_call_retried_with_its_task_id_is_replayed_not_run_again(
    ors: AsyncORS, http: httpx.AsyncClient, built_test_split: Rows
) -> None:
    index, row = first_writing_task(built_test_split)
    writes = [(n, a) for n, a in calls_from_actions(row["actions"]) if retail_pack.tools[n].mutates]
    name, arguments = writes[0]
    env = ors.environments.get("retail")
    async with env.session(split="test", index=index) as session:
        first = await session.call_tool(name, arguments)
        assert first.metadata["is_error"] is False  # type: ignore[index]
        call_id = first.metadata["call_id"]  # type: ignore[index]
        retry = await http.post(
            "/retail/call",
            json={"name": name, "input": arguments, "task_id": call_id},
            headers={"X-Session-ID": str(session.sid)},
        )
        # Run again, the write would fail (the order is no longer in the state it needs).
        again = await session.call_tool(name, arguments)
        await session.call_tool("submit", {"answer": "Done."})
        refused = await http.post(
            "/retail/call",
            json={"name": name, "input": arguments},
            headers={"X-Session-ID": str(session.sid)},
        )
    assert orjson.loads(events(refused.text)[-1][1]) == {
        "ok": False,
        "error": "episode_finished: the episode has ended (submit was called)",
        "reason": "episode_finished",
    }
    assert retry.status_code == 200 and retry.headers["content-type"].startswith("text/event-stream")
    received = events(retry.text)
    assert received[0] == ("task_id", call_id) and received[-1][0] == "end"
    replayed = orjson.loads(received[-1][1])
    assert replayed["output"]["blocks"][0]["text"] == first.blocks[0].text
    assert replayed["output"]["metadata"]["call_id"] == call_id
    assert again.metadata["is_error"] is True and again.blocks[0].text.startswith("Error: ")  # type: ignore[index]


# ---- the session's life and the stream ---------------------------------------------------------------


async def test_ping_create_and_delete_follow_the_session(
    http: httpx.AsyncClient, built_test_split: Rows
) -> None:
    opened = await http.post("/create_session")
    assert opened.headers["content-type"].startswith("text/event-stream")
    (kind, sid), end = events(opened.text)
    assert kind == "task_id" and uuid.UUID(sid).version == 4 and end == ("end", "")
    headers = {"X-Session-ID": sid}
    assert (await http.post("/ping", headers=headers)).json() == {"status": "ok"}
    both = {"task_spec": built_test_split[0], "split": "test", "index": 0}
    assert (await http.post("/create", json=both, headers=headers)).status_code == 400
    assert (await http.post("/create", json={}, headers=headers)).status_code == 400
    deep: Any = "x"
    for _ in range(200):
        deep = [deep]
    nested = await http.post(
        "/create", json={"env_name": "retail", "task_spec": {"x": deep}}, headers=headers
    )
    assert nested.status_code == 400 and "nests" in nested.json()["detail"]
    unknown = await http.post(
        "/create", json={"env_name": "airline", "split": "test", "index": 0}, headers=headers
    )
    assert unknown.status_code == 404
    made = await http.post("/create", json={"split": "test", "index": 0, "extra": 1}, headers=headers)
    assert made.json() == {"sid": sid}
    assert (
        await http.post("/create", json={"split": "test", "index": 1}, headers=headers)
    ).status_code == 400
    assert (await http.get("/faults/prompt", headers=headers)).status_code == 404  # not this session's env
    assert (await http.post("/delete", headers=headers)).json() == {"sid": sid}
    assert (await http.post("/ping", headers=headers)).status_code == 404
    assert (await http.post("/retail/call", json={"name": "calculate"}, headers=headers)).status_code == 404
    assert (await http.post("/delete_session", headers=headers)).json() == {"sid": sid}
    assert (await http.post("/ping", headers={"X-Session-ID": str(uuid.uuid4())})).status_code == 404


async def test_an_openenv_session_id_names_no_ors_session(url: str, http: httpx.AsyncClient) -> None:
    """ORS and OpenEnv keep their sessions in one store: an OpenEnv session (no episode yet, no trace)
    can be neither given a task, pinged, driven nor ended through ORS."""
    rpc = {"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create"}
    tools = {"Authorization": f"Bearer {TOOLS_KEY}"}
    opened = await http.post("/openenv/retail/mcp", json=rpc, headers=tools)
    headers = {"X-Session-ID": opened.json()["result"]["session_id"]}
    task = {"env_name": "retail", "split": "test", "index": 0}
    made = await http.post("/create", json=task, headers=headers)
    assert made.status_code == 400, made.text
    assert (await http.post("/ping", headers=headers)).status_code == 404
    await http.post("/delete", headers=headers)
    params = {"name": "list_all_product_types", "arguments": {}, "session_id": headers["X-Session-ID"]}
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": params}
    kept = (await http.post("/openenv/retail/mcp", json=call, headers=tools)).json()
    assert kept["error"]["message"] == "no episode yet: send reset first"  # still open, still OpenEnv's


async def test_a_crash_is_an_error_event_and_a_long_answer_arrives_whole(ors: AsyncORS) -> None:
    env = ors.environments.get("faults")
    async with env.session(task=Task(environment_name="faults", task_spec={"task_id": "f1"})) as session:
        big = await session.call_tool("big_output", {"size": 200_000})
        assert big.blocks[0].text == "x" * 200_000
        with pytest.raises(RuntimeError, match="RuntimeError"):
            await session.call_tool("crash", {})
        missing = await session.call_tool("submit", {})
        assert missing.metadata["is_error"] is True and missing.finished is False  # type: ignore[index]
        # The default grader (the only one: retail's) cannot grade this row: the episode ends in an error.
        with pytest.raises(RuntimeError, match="GraderMisconfigured"):
            await session.call_tool("submit", {"answer": "done"})
        with pytest.raises(ToolCallError, match=r"^episode_finished"):
            await session.call_tool("big_output", {"size": 1})


async def test_a_slow_call_keeps_the_stream_alive(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream starts with `task_id` and sends `: ping` comments until the answer."""
    monkeypatch.setattr(ors_module, "KEEPALIVE_SECONDS", 0.1)
    headers = {"X-Session-ID": "s-" + uuid.uuid4().hex}
    made = await http.post("/create", json={"env_name": "faults", "task_spec": {}}, headers=headers)
    assert made.status_code == 200, made.text
    answered = await http.post(
        "/faults/call", json={"name": "slow", "input": {"seconds": 1}}, headers=headers
    )
    received = events(answered.text)
    assert received[0][0] == "task_id" and ("", ": ping") in received
    assert orjson.loads(received[-1][1])["output"]["blocks"][0]["text"] == "done"


@pytest.mark.parametrize("backend", ["real"], indirect=True)
async def test_an_outage_answers_503_with_retry_after_and_the_retry_is_answered(
    app_factory: AppFactory, retail_data: Path
) -> None:
    proxy = await DroppingProxy("127.0.0.1", REDIS_PORT).start()
    try:
        async with app_factory(
            packs=[retail_pack],
            pack_settings={"retail": {"data": retail_data}},
            redis_url=f"redis://127.0.0.1:{proxy.port}/9",
        ) as client:
            key = {"X-API-Key": TOOLS_KEY, "X-Sparring-Run": "outage-run"}
            sid = events((await client.post("/create_session", headers=key)).text)[0][1]
            headers = {**key, "X-Session-ID": sid}
            assert (
                await client.post("/create", json={"split": "test", "index": 0}, headers=headers)
            ).status_code == 200
            call = {"name": "list_all_product_types", "input": {}, "task_id": "call_outage"}
            proxy.refusing = True
            proxy.drop()
            down = await client.post("/retail/call", json=call, headers=headers)
            assert down.status_code == 503 and int(down.headers["Retry-After"]) >= 1, down.text
            proxy.refusing = False
            up = events((await client.post("/retail/call", json=call, headers=headers)).text)
            answer = orjson.loads(up[-1][1])
            assert up[0] == ("task_id", "call_outage") and answer["ok"] is True
            assert answer["output"]["metadata"]["is_error"] is False
            trace = answer["output"]["metadata"]["trace_id"]
            logged = await client.get(f"/rollouts/{trace}", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert logged.json()["run"] == "outage-run"  # the X-Sparring-Run of the session's opening
    finally:
        await proxy.aclose()
