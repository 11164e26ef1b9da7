"""ORS under the SDK's retries: a step whose log commit failed is applied once, a submit resumed while
it grades gets its reward, a session id used again is a new rollout, and a task whose `messages` is not
a list still has a prompt."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from ors.client import AsyncORS
from ors.client._types import Task

from app.deps import app_state
from app.episodes import ors as ors_module
from app.episodes.sessions import EpisodeSession, SessionStore
from app.errors import ServiceUnavailable
from app.main import create_app
from tests.conftest import make_settings
from tests.episodes.test_ors import events
from tests.packs import counter_pack
from tests.remote.served import serve
from tools.retail import pack as retail_pack

ROW = {"task_id": "count-1", "messages": [{"role": "user", "content": "count"}]}


@pytest.fixture
def app(tmp_path: Path, backend_settings: dict[str, Any], retail_data: Path) -> FastAPI:
    settings = make_settings(tmp_path / "home", **backend_settings)
    return create_app(
        settings, packs=[counter_pack, retail_pack], pack_settings={"retail": {"data": retail_data}}
    )


@pytest.fixture
def url(app: FastAPI) -> Iterator[str]:
    with serve(app) as base:
        yield base


def end_payload(text: str) -> dict[str, Any]:
    """The payload of a `/call` stream's `chunk`s and `end`."""
    found: dict[str, Any] = orjson.loads("".join(d for e, d in events(text) if e in ("chunk", "end")))
    return found


async def test_a_step_whose_log_commit_failed_is_applied_once_under_the_sdks_retry(
    app: FastAPI, ors: AsyncORS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tool ran and its state and ledger were stored, but the call log's commit failed (an unknown
    fate: 503). The client must already hold the call id then, so ors-sdk's retry is the same call,
    replayed, not a new one that runs the tool again."""
    writer = app_state(app).call_service.log_writer
    enqueue, dropped = writer.enqueue, []

    def drop_the_first_increment(record: Any, *, alone: bool = False) -> asyncio.Future[None]:
        if record.tool == "increment" and not dropped:
            dropped.append(record)
            failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            failed.set_exception(ServiceUnavailable("the call log's commit failed"))
            return failed
        return enqueue(record, alone=alone)

    monkeypatch.setattr(writer, "enqueue", drop_the_first_increment)
    env = ors.environments.get("counter")
    async with env.session(task=Task(environment_name="counter", task_spec=ROW)) as session:
        incremented = await session.call_tool("increment", {"by": 1})
        read = await session.call_tool("read_counter", {})
    assert dropped, "the commit was not dropped: the test proves nothing"
    assert orjson.loads(incremented.blocks[0].text) == {"value": 101}
    assert orjson.loads(read.blocks[0].text) == {"value": 101}


async def test_a_submit_resumed_while_it_grades_gets_the_reward(
    app: FastAPI, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ors-sdk resumes a dropped `/call` stream by posting it again with its `task_id`: a submit resumed
    while its grade runs waits for that grade, and gets its reward instead of `episode_finished`."""
    monkeypatch.setattr(ors_module, "FIRST_WAIT_SECONDS", 0.05)
    claims: list[EpisodeSession] = []
    claim_submit = SessionStore.claim_submit

    async def counted_claim(self: SessionStore, session: EpisodeSession, **options: Any) -> bool:
        claims.append(session)
        return await claim_submit(self, session, **options)

    monkeypatch.setattr(SessionStore, "claim_submit", counted_claim)
    grading = app_state(app).grading
    grade = grading.grade

    async def grade_once_the_retry_was_refused(*args: Any, **kwargs: Any) -> Any:
        for _ in range(2000):  # bounded: a broken retry fails the test below, it does not hang it
            if len(claims) >= 2:
                break
            await asyncio.sleep(0.01)
        return await grade(*args, **kwargs)

    monkeypatch.setattr(grading, "grade", grade_once_the_retry_was_refused)
    headers = {"X-Session-ID": str(uuid.uuid4())}
    made = await http.post(
        "/create", json={"env_name": "retail", "split": "test", "index": 0}, headers=headers
    )
    assert made.status_code == 200, made.text
    body = {"name": "submit", "input": {"answer": "Done."}}
    async with http.stream("POST", "/retail/call", json=body, headers=headers) as first:
        lines = first.aiter_lines()
        task_id = ""
        async for line in lines:
            if line.startswith("data: "):
                task_id = line.removeprefix("data: ")
                break
        assert task_id
        resumed = await http.post("/retail/call", json={**body, "task_id": task_id}, headers=headers)
        answered = "\n".join([line async for line in lines])
    payload, first_payload = end_payload(resumed.text), end_payload(answered)
    assert payload["ok"] is True, payload
    assert payload["output"]["finished"] is True and payload["output"]["metadata"]["call_id"] == task_id
    assert payload["output"]["reward"] is not None
    assert payload["output"]["reward"] == first_payload["output"]["reward"]
    other = await http.post("/retail/call", json=body, headers=headers)  # a new submit: refused
    assert end_payload(other.text)["reason"] == "episode_finished"


async def test_a_session_id_used_again_after_delete_starts_a_fresh_rollout(http: httpx.AsyncClient) -> None:
    for sid in ("my-session-1", events((await http.post("/create_session")).text)[0][1]):
        headers = {"X-Session-ID": sid}
        traces = []
        for value in (105, 100):
            made = await http.post("/create", json={"env_name": "counter", "task_spec": ROW}, headers=headers)
            assert made.status_code == 200, made.text
            if value == 105:
                await http.post(
                    "/counter/call", json={"name": "increment", "input": {"by": 5}}, headers=headers
                )
            read = end_payload(
                (await http.post("/counter/call", json={"name": "read_counter"}, headers=headers)).text
            )
            assert orjson.loads(read["output"]["blocks"][0]["text"]) == {"value": value}, (sid, read)
            traces.append(read["output"]["metadata"]["trace_id"])
            assert (await http.post("/delete", headers=headers)).status_code == 200
        assert traces[0] != traces[1] and all(t.startswith(f"trace_ors_{sid}_") for t in traces)


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
@pytest.mark.parametrize("messages", [5, 1.5, True, "hi"])
async def test_the_prompt_of_a_task_whose_messages_is_not_a_list_is_empty(
    ors: AsyncORS, messages: Any
) -> None:
    env = ors.environments.get("counter")
    async with env.session(
        task=Task(environment_name="counter", task_spec={"messages": messages})
    ) as session:
        assert await session.get_prompt() == []
