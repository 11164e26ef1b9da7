"""ORS under the SDK's retries: a step whose log commit failed is applied once, a submit resumed while
it grades gets its reward, a session id used again is a new rollout, and a task whose `messages` is not
a list still has a prompt."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
from fastapi import FastAPI
from ors.client import AsyncORS
from ors.client._types import Task

from app.calls import log_writer
from app.deps import app_state
from app.episodes import episode as episode_module
from app.episodes import ors as ors_module
from app.episodes import sessions as sessions_module
from app.episodes.episode import EpisodeFinished, session_store, submit
from app.episodes.sessions import EpisodeSession, SessionStore
from app.errors import ServiceUnavailable
from app.main import create_app
from app.rollouts.store import RecordWrite
from tests.conftest import REDIS_URL, TOOLS_KEY, make_settings
from tests.episodes.test_ors import events
from tests.faults import DroppingProxy
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


SUBMIT_ROW: dict[str, Any] = {
    "task_id": "t",
    "messages": [{"role": "user", "content": "x"}],
    "actions": [],
    "outputs": [],
    "communicate_info": [],
}


async def _submits(services: Any, sid: str, call_id: str, times: int) -> list[str]:
    """What `times` resumed tries of one submit get, one after the other."""
    outcomes = []
    for _ in range(times):
        current = await session_store(services).get(sid)
        assert current is not None
        try:
            outcomes.append(f"reward {await submit(services, current, 'answer', call_id=call_id)}")
        except ServiceUnavailable:
            outcomes.append("503")
        except EpisodeFinished:
            outcomes.append("finished")
    return outcomes


async def _new_session(services: Any) -> EpisodeSession:
    made = await session_store(services).create(
        pack="retail", trace_id=f"trace_ors_{uuid.uuid4().hex}", row=SUBMIT_ROW, channel="ors", run="r"
    )
    assert made is not None
    return made


@pytest.mark.parametrize("how", ["cancelled", "give-back-lost"])
async def test_a_submit_whose_grading_try_vanished_is_graded_once_or_ends_never_hangs(
    retail: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Its first try stopped mid-grade (a shutdown cancels the work: the claim is given back, and a retry
    grades it, once), or failed in an outage that also lost the give-back of its claim (retries wait for
    that claim until it lapses, then are told the episode ended): never a 503 for ever (ors-sdk resumes
    the call on each stream end), never a second grade by a retry racing a first try still running."""
    services = app_state(retail.app)
    monkeypatch.setattr(episode_module, "SUBMIT_WAIT_SECONDS", 0.2)
    monkeypatch.setattr(sessions_module, "SUBMIT_LEASE_SECONDS", 0.5)
    real_grade, real_release = services.grading.grade, SessionStore.release_submit
    grades: list[int] = []
    lost: list[bool] = []
    grading = asyncio.Event()

    async def grade(*args: Any, **kwargs: Any) -> Any:
        grades.append(1)
        grading.set()
        if len(grades) == 1:
            if how == "cancelled":
                await asyncio.Event().wait()
            raise ServiceUnavailable("the store is down", 1)
        return await real_grade(*args, **kwargs)

    async def release(self: SessionStore, session: EpisodeSession) -> None:
        if how == "give-back-lost" and not lost:
            lost.append(True)
            raise ServiceUnavailable("the store is down", 1)  # the same outage: the give-back is lost
        await real_release(self, session)

    monkeypatch.setattr(services.grading, "grade", grade)
    monkeypatch.setattr(SessionStore, "release_submit", release)
    session = await _new_session(services)
    first = asyncio.ensure_future(submit(services, session, "answer", call_id="call_submit"))
    await grading.wait()
    if how == "cancelled":
        first.cancel()
    with pytest.raises((asyncio.CancelledError, ServiceUnavailable)):
        await first
    outcomes = await _submits(services, session.sid, "call_submit", 6)
    other = await _submits(services, session.sid, "another_call", 1)
    if how == "cancelled":
        assert outcomes[0].startswith("reward") and set(outcomes) == {outcomes[0]}, outcomes
        assert len(grades) == 2  # the cancelled try's and the retry's: the retries after it are replayed
    else:
        ended = outcomes.index("finished")
        assert ended > 0 and set(outcomes[:ended]) == {"503"} and set(outcomes[ended:]) == {"finished"}
        assert len(grades) == 1  # no retry graded while the first try's claim could still be live
    assert other == ["finished"]


async def test_a_retry_while_the_claim_is_being_made_waits_for_the_reward(
    retail: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim is two writes (its count, then its call id): a retry in between waits, never finishes."""
    services = app_state(retail.app)
    store = session_store(services).store
    real_put = type(store).record_put
    claimed, go_on = asyncio.Event(), asyncio.Event()

    async def held_put(self: Any, write: RecordWrite) -> Any:
        if "submit_call" in write.fields and "done" not in write.fields and not claimed.is_set():
            claimed.set()
            await go_on.wait()
        return await real_put(self, write)

    monkeypatch.setattr(type(store), "record_put", held_put)
    session = await _new_session(services)
    first = asyncio.ensure_future(submit(services, session, "answer", call_id="call_submit"))
    await claimed.wait()
    again = await session_store(services).get(session.sid)
    assert again is not None
    retry = asyncio.ensure_future(submit(services, again, "answer", call_id="call_submit"))
    await asyncio.sleep(0.1)  # the retry has looked at the claim, found no call id yet, and waits
    go_on.set()
    reward = await first
    assert await retry == reward


async def test_a_call_while_the_database_stalls_fails_within_the_sdks_retries(
    tmp_path: Path, pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Postgres stops answering: a resumed call waits past the call log's bound, so the outage is a 503
    that ors-sdk counts against its retries (a stream that ends early resets its count: the call would
    be resumed forever), and the step fails after them instead of hanging the rollout."""
    monkeypatch.setattr(log_writer, "COMMIT_TIMEOUT_SECONDS", 1.0)  # 15 s and 25 s as shipped, in order
    monkeypatch.setattr(ors_module, "FIRST_WAIT_SECONDS", 2.0)
    posts: list[str] = []
    answer_call = ors_module.answer_call

    async def counted(*args: Any, **kwargs: Any) -> Any:
        posts.append(args[-1])
        return await answer_call(*args, **kwargs)

    monkeypatch.setattr(ors_module, "answer_call", counted)
    pg = urlsplit(pg_database)
    loop = asyncio.new_event_loop()  # the proxy's own loop: serve() blocks this one while it starts
    threading.Thread(target=loop.run_forever, daemon=True).start()
    proxy = asyncio.run_coroutine_threadsafe(
        DroppingProxy(pg.hostname or "127.0.0.1", pg.port or 5432).start(), loop
    )
    stalling = proxy.result()
    host = f"127.0.0.1:{stalling.port}"
    url = pg._replace(netloc=f"{pg.username}@{host}" if pg.username else host).geturl()
    app = create_app(
        make_settings(tmp_path / "home", database_url=url, redis_url=REDIS_URL), packs=[counter_pack]
    )
    outcome = "hung"
    try:
        with serve(app) as base:
            client = AsyncORS(base_url=base, api_key=TOOLS_KEY)
            env = client.environments.get("counter")
            async with env.session(task=Task(environment_name="counter", task_spec=ROW)) as session:
                stalling.stalled = True
                try:
                    await asyncio.wait_for(session.call_tool("increment", {"by": 1}), 60)
                    outcome = "answered"
                except TimeoutError:
                    outcome = "hung"
                except Exception as exc:  # what a bounded outage ends in
                    outcome = type(exc).__name__
                stalling.stalled = False
                loop.call_soon_threadsafe(stalling.drop)
    finally:
        asyncio.run_coroutine_threadsafe(stalling.aclose(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
    assert outcome == "MaxRetriesError" and len(posts) <= 6, (outcome, posts)
