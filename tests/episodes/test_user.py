"""Episodes with the server's simulated user: `send_message_to_user` is a step, the reply its answer."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.episodes.episode import SEND_TO_USER, call_tool, session_store, submit
from app.episodes.sessions import EpisodeSession
from app.episodes.tasks import load_task_rows
from app.errors import ServiceUnavailable
from sparring.usersim import GREETING, STOP, USER_ROLE
from sparring.wire import USER_CALL_PREFIX
from tests.conftest import ADMIN_KEY, TOOLS_KEY, AppFactory
from tests.episodes.conftest import gold_answer
from tests.episodes.test_episode import open_session, state_of, write_task
from tests.runner.conftest import model_server, model_server_process
from tests.runner.model_server import ModelRequest, ModelServer, Reply, Unavailable
from tools.retail import pack as retail_pack
from tools.retail.tasks import calls_from_actions

__all__ = ["model_server", "model_server_process"]

OPENING = "Hi, I want to return something."


def user_script(request: ModelRequest) -> Reply:
    if request.model == "down":
        raise Unavailable
    answered = sum(1 for m in request.body["messages"] if m["role"] == "assistant")
    return Reply(text=OPENING if answered == 0 else f"Thanks! {STOP}")


@pytest.fixture
async def with_user(
    app_factory: AppFactory, retail_data: Path, model_server: ModelServer, request: pytest.FixtureRequest
) -> AsyncIterator[httpx.AsyncClient]:
    model_server.script = user_script
    async with app_factory(
        packs=[retail_pack],
        pack_settings={"retail": {"data": retail_data}},
        user_model=getattr(request, "param", "user"),
        user_base_url=model_server.base_url,
        remote_allowed_hosts=["127.0.0.1"],
    ) as client:
        yield client


async def test_with_the_user_tool_too_the_protocols_list_send_message_to_user_once(
    app_factory: AppFactory, retail_data: Path, model_server: ModelServer
) -> None:
    async with app_factory(
        packs=[retail_pack],
        pack_settings={"retail": {"data": retail_data}},
        user_model="user",
        user_base_url=model_server.base_url,
        user_tool=True,
        remote_allowed_hosts=["127.0.0.1"],
    ) as client:
        listed = (await client.get("/retail/tools", headers={"X-API-Key": TOOLS_KEY})).json()
    assert [tool["name"] for tool in listed["tools"]].count(SEND_TO_USER) == 1


async def first_row(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await load_task_rows(state_of(client).registry, "retail", "test"))[0]


async def test_the_user_answers_each_message_across_requests_until_it_stops(
    with_user: httpx.AsyncClient, model_server: ModelServer
) -> None:
    services, row = state_of(with_user), await first_row(with_user)
    session = await open_session(with_user, row)

    first = await call_tool(services, session, SEND_TO_USER, {"message": GREETING}, "m1")
    assert (first.output, first.is_error) == (OPENING, False)
    again = await session_store(services).get(session.sid)  # another request, maybe another worker
    assert again is not None and [m["role"] for m in again.user["messages"]] == ["assistant", USER_ROLE]
    second = await call_tool(services, again, SEND_TO_USER, {"message": "Your return is done."}, "m2")
    assert second.output == f"Thanks! {STOP}" and not second.is_error
    last = model_server.requests[-1]
    assert "<scenario>" in last.system
    assert [(m["role"], m["content"]) for m in last.body["messages"][1:]] == [
        ("user", GREETING),
        ("assistant", OPENING),
        ("user", "Your return is done."),
    ]
    ended = await session_store(services).get(session.sid)
    assert ended is not None and ended.user["ended"] == "user_stop" and ended.step_count == 2
    after = await call_tool(services, ended, SEND_TO_USER, {"message": "Anything else?"}, "m3")
    assert after.is_error and after.output.startswith("Error: the customer has ended the conversation")
    bad = await call_tool(services, ended, SEND_TO_USER, {"text": "hi"}, "m4")
    assert bad.is_error and bad.output.startswith(f"Error: {SEND_TO_USER} takes one argument")


async def test_a_message_retried_under_its_call_id_is_answered_again_not_sent_again(
    with_user: httpx.AsyncClient, model_server: ModelServer
) -> None:
    """ORS resumes a `/call` whose stream dropped with its `task_id`: a `send_message_to_user` retried
    under the same call id gets the user's reply again; the user does not hear the message twice."""
    services, row = state_of(with_user), await first_row(with_user)
    session = await open_session(with_user, row)
    first = await call_tool(services, session, SEND_TO_USER, {"message": GREETING}, "m1")
    asked = len(model_server.requests)
    again = await session_store(services).get(session.sid)
    assert again is not None
    retried = await call_tool(services, again, SEND_TO_USER, {"message": GREETING}, "m1")
    assert (retried.output, retried.is_error) == (first.output, first.is_error) == (OPENING, False)
    assert len(model_server.requests) == asked
    kept = await session_store(services).get(session.sid)
    assert kept is not None and [m["role"] for m in kept.user["messages"]] == ["assistant", USER_ROLE]
    assert kept.step_count == 1


async def test_two_messages_sent_at_once_take_turns_and_both_are_kept(
    with_user: httpx.AsyncClient, model_server: ModelServer
) -> None:
    """The agent writes to the user twice in one turn (parallel calls, each request reading the session
    as it was): the user answers one message after the other, and the conversation keeps both."""
    services, row = state_of(with_user), await first_row(with_user)
    session = await open_session(with_user, row)
    stale = [await session_store(services).get(session.sid) for _ in range(2)]
    first, second = await asyncio.gather(
        *(
            call_tool(services, read, SEND_TO_USER, {"message": text}, call_id)  # type: ignore[arg-type]
            for read, text, call_id in zip(stale, (GREETING, "Which order?"), ("m1", "m2"), strict=True)
        )
    )
    assert {first.output, second.output} == {OPENING, f"Thanks! {STOP}"}
    kept = await session_store(services).get(session.sid)
    assert kept is not None and kept.step_count == 2
    assert [m["role"] for m in kept.user["messages"]] == ["assistant", USER_ROLE] * 2


async def test_the_protocols_list_send_message_to_user_when_the_server_has_a_user(
    with_user: httpx.AsyncClient,
) -> None:
    listed = (await with_user.get("/retail/tools", headers={"X-API-Key": TOOLS_KEY})).json()
    assert listed["tools"][-1]["name"] == SEND_TO_USER
    assert listed["tools"][-1]["input_schema"]["required"] == ["message"]


@pytest.mark.parametrize("with_user", ["down"], indirect=True)
async def test_a_user_model_outage_is_an_error_the_agent_reads_and_may_retry(
    with_user: httpx.AsyncClient,
) -> None:
    services = state_of(with_user)
    session = await open_session(with_user, await first_row(with_user))
    answer = await call_tool(services, session, SEND_TO_USER, {"message": GREETING}, "m1")
    assert answer.is_error
    assert answer.output == (
        "Error: the customer could not answer (the model endpoint answered HTTP 503); send your message again"
    )
    kept = await session_store(services).get(session.sid)
    assert kept is not None and kept.user == {} and kept.step_count == 0


@asynccontextmanager
async def telecom_episode(
    app_factory: AppFactory, model_server: ModelServer
) -> AsyncIterator[tuple[httpx.AsyncClient, Any, EpisodeSession]]:
    """A server with the telecom pack and the test model server as its user model, and an episode of
    the scripted task (the row carries no user_simulator: the pack's scenario loader gives it, by
    task_id)."""
    from tests.telecom import corpus
    from tests.usersim.telecom_script import TASK
    from tools.telecom import pack as telecom_pack

    async with app_factory(
        packs=[telecom_pack],
        key=ADMIN_KEY,
        pack_settings={"telecom": {"data": corpus.fetch()}},
        user_model="user",
        user_base_url=model_server.base_url,
        remote_allowed_hosts=["127.0.0.1"],
    ) as client:
        services = state_of(client)
        session = await session_store(services).create(
            pack="telecom",
            trace_id=f"trace_ors_{uuid.uuid4()}",
            row={"task_id": TASK},
            channel="ors",
            run="ep",
        )
        assert session is not None
        yield client, services, session


async def test_a_telecom_customer_fixes_its_phone_in_process_between_two_steps(
    app_factory: AppFactory, model_server: ModelServer
) -> None:
    from tests.telecom import corpus
    from tests.usersim.telecom_script import ASK, DONE, OPENING, TASK
    from tests.usersim.test_user_tool import User

    model_server.script = User()
    async with telecom_episode(app_factory, model_server) as (client, services, session):
        first = await call_tool(services, session, SEND_TO_USER, {"message": GREETING}, "m1")
        assert first.output == OPENING
        again = await session_store(services).get(session.sid)
        assert again is not None
        second = await call_tool(services, again, SEND_TO_USER, {"message": ASK}, "m2")
        assert (second.output, second.is_error) == (DONE, False)
        detail = (await client.get(f"/review/api/rollouts/{session.trace_id}")).json()
    phone = [name for side, name, _ in corpus.gold_calls(TASK) if side == "user"]
    users = [c for c in detail["timeline"] if c["channel"] == "user"]
    assert [c["tool"] for c in users] == phone and all(c["outcome"] == "ok" for c in users)
    assert all(c["call_id"].startswith(USER_CALL_PREFIX) for c in users)
    assert any("Airplane Mode is now OFF" in output for _, output in model_server.requests[-1].outputs)


async def test_a_message_sent_again_after_the_user_failed_goes_on_from_its_own_calls(
    app_factory: AppFactory, model_server: ModelServer
) -> None:
    """The user turns airplane mode off, then its model fails: the agent reads an error and sends its
    message again. The user goes on from the call it made (it does not make it again: a second toggle
    would turn airplane mode back on)."""
    from tests.telecom import corpus
    from tests.usersim.telecom_script import ASK, DONE, TASK
    from tests.usersim.test_user_tool import User

    user = model_server.script = User()
    async with telecom_episode(app_factory, model_server) as (client, services, session):
        await call_tool(services, session, SEND_TO_USER, {"message": GREETING}, "m1")
        user.down_at = 2  # after its first phone call
        session = await session_store(services).get(session.sid)
        assert session is not None
        failed = await call_tool(services, session, SEND_TO_USER, {"message": ASK}, "m2")
        assert failed.is_error and "send your message again" in failed.output
        user.down_at = None
        session = await session_store(services).get(session.sid)
        assert session is not None
        again = await call_tool(services, session, SEND_TO_USER, {"message": ASK}, "m3")
        assert (again.output, again.is_error) == (DONE, False)
        detail = (await client.get(f"/review/api/rollouts/{session.trace_id}")).json()
    phone = [name for side, name, _ in corpus.gold_calls(TASK) if side == "user"]
    assert [c["tool"] for c in detail["timeline"] if c["channel"] == "user"] == phone
    asked = [m["content"] for m in model_server.requests[-1].body["messages"] if m["role"] == "user"]
    assert asked == [GREETING, ASK]  # the message sent again is the one the user was answering


async def test_a_message_resumed_after_an_outage_in_the_users_own_calls_does_not_call_again(
    app_factory: AppFactory, model_server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user fixes both settings in one turn; the second call meets an outage after the first turned
    airplane mode off, and the step is a 503. The client sends the same message again (ORS resumes the
    call under its id): the user finishes that turn of calls (the first replays, the second runs) and
    is not asked for a new one, which would toggle airplane mode back on."""
    from app.sdk import ToolUnavailable
    from tests.runner.model_server import Call
    from tests.telecom import corpus
    from tests.usersim.telecom_script import ASK, DONE, TASK
    from tests.usersim.test_user_tool import User
    from tools.telecom import device_tools

    user = model_server.script = User()
    phone = tuple(Call(name, args) for side, name, args in corpus.gold_calls(TASK) if side == "user")
    assert [call.name for call in phone] == ["toggle_airplane_mode", "toggle_data_saver_mode"]
    user.turns = [Reply(text=user.turns[0].text), Reply(calls=phone), Reply(text=DONE)]
    toggled = device_tools._toggled
    down = [True]

    def flaky(*args: Any, **kwargs: Any) -> str:  # data saver's toggle: down once, then back
        if down[0]:
            down[0] = False
            raise ToolUnavailable("the phone is unreachable")
        return toggled(*args, **kwargs)

    monkeypatch.setattr(device_tools, "_toggled", flaky)
    async with telecom_episode(app_factory, model_server) as (client, services, session):
        await call_tool(services, session, SEND_TO_USER, {"message": GREETING}, "m1")
        session = await session_store(services).get(session.sid)
        assert session is not None
        with pytest.raises(ServiceUnavailable):
            await call_tool(services, session, SEND_TO_USER, {"message": ASK}, "m2")
        session = await session_store(services).get(session.sid)
        assert session is not None
        again = await call_tool(services, session, SEND_TO_USER, {"message": ASK}, "m2")
        assert (again.output, again.is_error) == (DONE, False)
        detail = (await client.get(f"/review/api/rollouts/{session.trace_id}")).json()
    assert len(model_server.requests) == 3  # the opening, the turn of calls, the answer: once each
    toggles = [c["tool"] for c in detail["timeline"] if c["channel"] == "user" and c["outcome"] == "ok"]
    assert toggles == [call.name for call in phone]


@pytest.mark.parametrize(
    ("max_steps", "ended_by", "reward"), [(200, "user_stop", 1.0), (3, "max_steps", 0.0)]
)
async def test_an_episode_whose_conversation_ran_out_of_steps_is_rewarded_0_as_tau2_rewards_it(
    app_factory: AppFactory,
    retail_data: Path,
    model_server: ModelServer,
    max_steps: int,
    ended_by: str,
    reward: float,
) -> None:
    # The agent's greeting (1), the user's opening (2), the agent's answer (3): with 3 steps the user
    # never stops, and τ²-bench's evaluator rewards a simulation that ended by MAX_STEPS 0 however
    # right its database and messages are; with τ²'s 200 the user stops and the gold work scores 1.
    model_server.script = user_script
    async with app_factory(
        packs=[retail_pack],
        pack_settings={"retail": {"data": retail_data}},
        user_model="user",
        user_base_url=model_server.base_url,
        user_max_steps=max_steps,
        remote_allowed_hosts=["127.0.0.1"],
    ) as client:
        services, row = state_of(client), await write_task(client)
        session = await open_session(client, row)
        await call_tool(services, session, SEND_TO_USER, {"message": GREETING}, "m1")
        for n, (name, arguments) in enumerate(calls_from_actions(row["actions"])):
            assert not (await call_tool(services, session, name, arguments, f"call_{n}")).is_error
        answer = gold_answer(row)
        await call_tool(services, session, SEND_TO_USER, {"message": answer}, "m2")
        current = await session_store(services).get(session.sid)
        assert current is not None and current.user["ended"] == ended_by
        assert await submit(services, current, answer) == reward
        timeline = await client.get(
            f"/review/api/rollouts/{session.trace_id}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        )
        (grade,) = timeline.json()["grades"]
        assert ("premature_end" in {flag["name"] for flag in grade["flags"]}) == (reward == 0.0)
