"""`send_message_to_user` (SPARRING_USER_TOOL): a tool-only loop holds τ²'s conversation with the server's
simulated user. Offered only with the setting, in the packs with user scenarios; its output is the user's
reply, the user's own phone calls running in between (logged on the channel `user`, ids `user_...`); the
conversation is the rollout's (any request continues it); a retried call_id replays its reply; the
user's ###STOP### is in the reply and in the stored transcript; a user model outage is a 503."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest

from app.calls.service import SEND_TO_USER
from app.cli import job_config
from app.deps import app_state
from app.packs import Registry
from app.sdk import ToolUnavailable
from app.users.service import offer_user_tool
from sparring.usersim import GREETING, STOP
from sparring.wire import USER_CALL_PREFIX
from tests.conftest import ADMIN_KEY, REDIS_URL, AppFactory, make_settings, new_trace
from tests.faults import DroppingProxy
from tests.mcp.conftest import in_process, mcp_client
from tests.packs import counter_pack
from tests.runner.model_server import Call, ModelRequest, ModelServer, Reply, Unavailable
from tests.telecom import corpus
from tests.usersim.telecom_script import ASK, DONE, FAREWELL, OPENING, SOLVED, TASK
from tools.retail import pack as retail_pack
from tools.telecom import device_tools, pack


class User:
    """The scripted customer: its turns in order (a turn is the number of its turns already in the
    request), its phone's gold calls between the agent's request and its answer; `down` answers 503."""

    def __init__(self) -> None:
        corpus.fetch()  # the task's gold calls are read from the data (fetched once per machine)
        phone = [
            Reply(calls=(Call(name, args),)) for side, name, args in corpus.gold_calls(TASK) if side == "user"
        ]
        self.turns = [Reply(text=OPENING), *phone, Reply(text=DONE), Reply(text=FAREWELL)]
        self.down = False
        self.down_at: int | None = None  # a turn the model cannot answer
        self.before_calls: Callable[[], None] | None = None  # run before it answers a turn of calls

    def __call__(self, request: ModelRequest) -> Reply:
        turn = sum(1 for m in request.body["messages"] if m["role"] == "assistant")
        if self.down or turn == self.down_at:
            raise Unavailable
        if self.turns[turn].calls and self.before_calls is not None:
            self.before_calls()
        return self.turns[turn]


@pytest.fixture
async def served(
    app_factory: AppFactory, model_server: ModelServer, request: pytest.FixtureRequest
) -> AsyncIterator[httpx.AsyncClient]:
    telecom_data = corpus.fetch()  # before the script, which reads the task's gold calls
    model_server.script = User()
    async with app_factory(
        packs=[pack],
        key=ADMIN_KEY,
        pack_settings={"telecom": {"data": telecom_data}},
        user_model="user",
        user_base_url=model_server.base_url,
        user_tool=getattr(request, "param", True),
        remote_allowed_hosts=["127.0.0.1"],
    ) as client:
        yield client


async def send(
    client: httpx.AsyncClient, trace: str, message: str, call_id: str, route: str = f"/tools/{SEND_TO_USER}"
) -> httpx.Response:
    body = {
        "type": "function_call",
        "call_id": call_id,
        "name": SEND_TO_USER,
        "arguments": orjson.dumps({"message": message}).decode(),
        "trace_id": trace,
        "item": {"task_id": TASK},  # no user_simulator: the pack's scenario loader gives it
    }
    return await client.post(route, json=body)


async def said(client: httpx.AsyncClient, trace: str, message: str, call_id: str) -> str:
    answer = await send(client, trace, message, call_id)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["output"])


def user_requests(model_server: ModelServer) -> list[ModelRequest]:
    return [request for request in model_server.requests if request.model == "user"]


async def test_the_tool_is_offered_only_with_the_setting_in_packs_with_user_scenarios(
    served: httpx.AsyncClient,
) -> None:
    listed = {tool["name"]: tool for tool in (await served.get("/tools")).json()}
    assert list(listed) == [*pack.tools, SEND_TO_USER]
    assert listed[SEND_TO_USER]["pack"] == "telecom"
    assert listed[SEND_TO_USER]["parameters"]["required"] == ["message"]
    on_pack = [tool["name"] for tool in (await served.get("/tools?pack=telecom")).json()]
    assert on_pack[-1] == SEND_TO_USER
    state = app_state(served.app)  # type: ignore[attr-defined]
    block = job_config(state.settings, state.registry, "https://env.example", "telecom", "telecom")
    assert block["tools"][-1] == {
        "name": SEND_TO_USER,
        "server_url": f"https://env.example/packs/telecom/tools/{SEND_TO_USER}",
        "headers": block["tools"][0]["headers"],
    }
    async with mcp_client("http://127.0.0.1/mcp", transport=in_process(served.app)) as mcp:  # type: ignore[attr-defined]
        assert SEND_TO_USER in {tool.name for tool in (await mcp.list_tools()).tools}
    # Only packs with user scenarios (a scenario loader) get it.
    registry = Registry.from_packs([retail_pack, pack, counter_pack])
    assert offer_user_tool(registry) == ["retail", "telecom"]
    assert registry.shared[SEND_TO_USER] == ("retail", "telecom")
    assert SEND_TO_USER not in registry.pack_tools[counter_pack.name]


@pytest.mark.parametrize("served", [False], indirect=True)
async def test_without_the_setting_there_is_no_such_tool(
    served: httpx.AsyncClient, model_server: ModelServer
) -> None:
    assert SEND_TO_USER not in [tool["name"] for tool in (await served.get("/tools")).json()]
    answer = await said(served, new_trace(), GREETING, "m1")
    assert answer.startswith(f"Error: unknown tool {SEND_TO_USER!r}")
    assert user_requests(model_server) == []


@pytest.mark.parametrize("ids_per_answer", [False, True], ids=["unique-call-ids", "call-ids-per-answer"])
async def test_a_tool_only_loop_holds_the_conversation_and_is_graded_on_the_final_state(
    served: httpx.AsyncClient, model_server: ModelServer, ids_per_answer: bool
) -> None:
    """With `ids_per_answer` the user model names the first call of each of its answers `call_0`: each
    of its calls still runs once, under an id of its own."""
    model_server.ids_per_answer = ids_per_answer
    trace = new_trace()
    assert await said(served, trace, GREETING, "m1") == OPENING
    # The user fixes its phone (two calls of its own) before it answers; the agent reads only the answer.
    assert await said(served, trace, ASK, "m2") == DONE
    assert len(user_requests(model_server)) == 4
    (_, name, arguments) = next(c for c in corpus.gold_calls(TASK) if c[0] == "assistant")
    fixed = await served.post(
        f"/tools/{name}",
        json={"call_id": "a1", "arguments": arguments, "trace_id": trace, "item": {"task_id": TASK}},
    )
    assert fixed.status_code == 200 and not fixed.json()["output"].startswith("Error"), fixed.text
    # A retry of a call already answered replays its reply: the user is not asked again.
    assert await said(served, trace, ASK, "m2") == DONE
    assert len(user_requests(model_server)) == 4
    reused = await said(served, trace, "Something else", "m2")
    assert reused.startswith("Error: call_id 'm2' was already used for a different call")
    ended = await said(served, trace, SOLVED, "m3")
    assert ended == FAREWELL and STOP in ended
    after = await said(served, trace, "Anything else?", "m4")
    assert after == "Error: the customer has ended the conversation (user_stop)"
    assert len(user_requests(model_server)) == 5

    # The user model read τ²'s prompt for a user with tools, the conversation role-flipped, and its own
    # calls' results (which the agent never read).
    last = user_requests(model_server)[-1]
    assert "<scenario>" in last.system and last.tools == list(pack.user_tools)
    flipped = [(m["role"], m.get("content")) for m in last.body["messages"][1:] if m["role"] != "tool"]
    assert flipped[:2] == [("user", GREETING), ("assistant", OPENING)]
    assert flipped[-2:] == [("assistant", DONE), ("user", SOLVED)]
    assert any("Airplane Mode is now OFF" in output for _, output in last.outputs)

    graded = await served.post(
        "/grade/telecom",
        json={"sample": {"output_text": ended}, "item": {"task_id": TASK}, "trace_id": trace},
    )
    assert graded.status_code == 200 and graded.json()["score"] == 1.0, graded.text

    detail = (await served.get(f"/review/api/rollouts/{trace}")).json()
    calls = [(c["tool"], c["channel"], c["call_id"]) for c in detail["timeline"]]
    phone = [n for side, n, _ in corpus.gold_calls(TASK) if side == "user"]
    assert [tool for tool, channel, _ in calls if channel == "user"] == phone
    assert all(call_id.startswith(USER_CALL_PREFIX) for _, channel, call_id in calls if channel == "user")
    assert len({call_id for _, channel, call_id in calls if channel == "user"}) == len(phone)
    sends = [(c["call_id"], c["outcome"]) for c in detail["timeline"] if c["tool"] == SEND_TO_USER]
    # The replay of m2 is the same answer (the timeline shows a call once); the reuse is its own row.
    assert sends == [
        ("m1", "ok"),
        ("m2", "ok"),
        ("m2", "call_id_reused"),
        ("m3", "ok"),
        ("m4", "model_error"),
    ]
    # The stored transcript: each message of the agent, the user's reply, the call's output; STOP in it.
    messages = detail["transcript"]["messages"]
    assert detail["transcript"]["source"] == "user_tool"
    assert [(m["role"], m["content"]) for m in messages if m["role"] != "assistant"] == [
        ("simulated_user", OPENING),
        ("tool", OPENING),
        ("simulated_user", DONE),
        ("tool", DONE),
        ("simulated_user", FAREWELL),
        ("tool", FAREWELL),
    ]
    sent = [m["tool_calls"][0] for m in messages if m["role"] == "assistant"]
    assert [(c["call_id"], orjson.loads(c["arguments"])["message"]) for c in sent] == [
        ("m1", GREETING),
        ("m2", ASK),
        ("m3", SOLVED),
    ]


async def test_two_messages_sent_at_once_take_turns(
    served: httpx.AsyncClient, model_server: ModelServer
) -> None:
    """A policy's parallel calls of one turn: the second message reads the conversation the first
    left, so the user answers each in turn (neither reply is lost, no turn is played twice)."""
    trace = new_trace()
    first, second = await asyncio.gather(send(served, trace, GREETING, "m1"), send(served, trace, ASK, "m2"))
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert sorted([first.json()["output"], second.json()["output"]]) == sorted([OPENING, DONE])
    assert len(user_requests(model_server)) == 4  # the opening, two phone calls, the answer
    detail = (await served.get(f"/review/api/rollouts/{trace}")).json()
    replies = [m["content"] for m in detail["transcript"]["messages"] if m["role"] == "simulated_user"]
    assert replies == [OPENING, DONE]


async def test_a_user_model_outage_is_a_503_and_the_retry_gets_the_reply(
    served: httpx.AsyncClient, model_server: ModelServer
) -> None:
    user: Any = model_server.script
    user.down = True
    trace = new_trace()
    failed = await send(served, trace, GREETING, "m1")
    assert failed.status_code == 503, failed.text
    assert failed.headers["Retry-After"]
    assert "the simulated user could not answer" in failed.json()["error"]["message"]
    user.down = False  # the platform retries the same call: it runs again, nothing was kept
    assert await said(served, trace, GREETING, "m1") == OPENING
    assert await said(served, trace, ASK, "m2") == DONE


async def test_a_retry_goes_on_from_the_users_own_calls_that_ran_before_an_outage(
    served: httpx.AsyncClient, model_server: ModelServer
) -> None:
    user: Any = model_server.script
    trace = new_trace()
    assert await said(served, trace, GREETING, "m1") == OPENING
    user.down_at = 2  # the user turns airplane mode off, then its model fails before the next call
    failed = await send(served, trace, ASK, "m2")
    assert failed.status_code == 503, failed.text
    user.down_at = None
    # The retry does not ask for the first call again (it would turn airplane mode back on): the user
    # reads its result and goes on.
    assert await said(served, trace, ASK, "m2") == DONE
    detail = (await served.get(f"/review/api/rollouts/{trace}")).json()
    phone = [n for side, n, _ in corpus.gold_calls(TASK) if side == "user"]
    assert [c["tool"] for c in detail["timeline"] if c["channel"] == "user"] == phone
    resumed = user_requests(model_server)[-2]
    assert [m["role"] for m in resumed.body["messages"]][-4:] == ["assistant", "user", "assistant", "tool"]
    assert await said(served, trace, SOLVED, "m3") == FAREWELL
    (_, name, arguments) = next(c for c in corpus.gold_calls(TASK) if c[0] == "assistant")
    body = {"call_id": "a1", "arguments": arguments, "trace_id": trace, "item": {"task_id": TASK}}
    assert (await served.post(f"/tools/{name}", json=body)).status_code == 200
    graded = await served.post(
        "/grade/telecom",
        json={"sample": {"output_text": FAREWELL}, "item": {"task_id": TASK}, "trace_id": trace},
    )
    assert graded.json()["score"] == 1.0, graded.text


async def test_a_retry_finishes_a_turn_of_the_users_calls_that_an_outage_cut_short(
    served: httpx.AsyncClient, model_server: ModelServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user fixes both settings in one turn; the second call meets an outage after the first has
    turned airplane mode off. The retry runs that turn's calls again under their ids (the first
    replays, the second runs): asking the model for a new turn would toggle airplane mode back on."""
    user: Any = model_server.script
    phone = tuple(Call(name, args) for side, name, args in corpus.gold_calls(TASK) if side == "user")
    assert [call.name for call in phone] == ["toggle_airplane_mode", "toggle_data_saver_mode"]
    user.turns = [Reply(text=OPENING), Reply(calls=phone), Reply(text=DONE), Reply(text=FAREWELL)]
    toggled = device_tools._toggled
    down = [True]

    def flaky(*args: Any, **kwargs: Any) -> str:  # data saver's toggle: down once, then back
        if down[0]:
            down[0] = False
            raise ToolUnavailable("the phone is unreachable")
        return toggled(*args, **kwargs)

    monkeypatch.setattr(device_tools, "_toggled", flaky)
    trace = new_trace()
    assert await said(served, trace, GREETING, "m1") == OPENING
    failed = await send(served, trace, ASK, "m2")
    assert failed.status_code == 503, failed.text
    assert await said(served, trace, ASK, "m2") == DONE
    assert len(user_requests(model_server)) == 3  # the opening, the turn of calls, the answer: once each
    assert await said(served, trace, SOLVED, "m3") == FAREWELL
    (_, name, arguments) = next(c for c in corpus.gold_calls(TASK) if c[0] == "assistant")
    body = {"call_id": "a1", "arguments": arguments, "trace_id": trace, "item": {"task_id": TASK}}
    assert (await served.post(f"/tools/{name}", json=body)).status_code == 200
    graded = await served.post(
        "/grade/telecom",
        json={"sample": {"output_text": FAREWELL}, "item": {"task_id": TASK}, "trace_id": trace},
    )
    assert graded.json()["score"] == 1.0, graded.text


async def test_an_outage_of_the_state_during_the_users_own_calls_is_a_503(
    app_factory: AppFactory, model_server: ModelServer
) -> None:
    user = model_server.script = User()
    proxy = await DroppingProxy("127.0.0.1", int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])).start()
    loop = asyncio.get_running_loop()

    def redis_goes_down() -> None:  # on the model server's thread, before its answer is sent
        proxy.refusing = True
        loop.call_soon_threadsafe(proxy.drop)

    try:
        async with app_factory(
            packs=[pack],
            key=ADMIN_KEY,
            pack_settings={"telecom": {"data": corpus.fetch()}},
            redis_url=f"redis://127.0.0.1:{proxy.port}/9",
            user_model="user",
            user_base_url=model_server.base_url,
            user_tool=True,
            remote_allowed_hosts=["127.0.0.1"],
        ) as client:
            trace = new_trace()
            assert await said(client, trace, GREETING, "m1") == OPENING
            user.before_calls = redis_goes_down
            down = await send(client, trace, ASK, "m2")
            assert down.status_code == 503 and int(down.headers["Retry-After"]) >= 1, down.text
            message = down.json()["error"]["message"]
            assert message == "the simulated user could not answer: rollout state store unreachable"
            proxy.refusing = False
    finally:
        await proxy.aclose()


def test_the_setting_needs_a_user_model(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="set SPARRING_USER_MODEL"):
        make_settings(tmp_path, user_tool=True)
    assert make_settings(tmp_path, user_tool=True, user_model="user").user_tool


async def test_a_conversation_that_ran_out_of_steps_is_graded_0(
    app_factory: AppFactory, model_server: ModelServer
) -> None:
    """The user's answer on the last allowed step ends the conversation as max_steps: τ² rewards such a
    rollout 0, whatever the agent did after it, and so does the pack's grader (the grade's sample, sent
    by the platform, does not say how the conversation ended: the rollout's conversation does)."""
    model_server.script = User()
    async with app_factory(
        packs=[pack],
        key=ADMIN_KEY,
        pack_settings={"telecom": {"data": corpus.fetch()}},
        user_model="user",
        user_base_url=model_server.base_url,
        user_tool=True,
        user_max_steps=8,  # the greeting and the opening, the ask, two calls and their results, the answer
        remote_allowed_hosts=["127.0.0.1"],
    ) as client:
        trace = new_trace()
        assert await said(client, trace, GREETING, "m1") == OPENING
        assert await said(client, trace, ASK, "m2") == DONE
        after = await said(client, trace, SOLVED, "m3")
        assert after == "Error: the customer has ended the conversation (max_steps)"
        (_, name, arguments) = next(c for c in corpus.gold_calls(TASK) if c[0] == "assistant")
        body = {"call_id": "a1", "arguments": arguments, "trace_id": trace, "item": {"task_id": TASK}}
        assert (await client.post(f"/tools/{name}", json=body)).status_code == 200
        graded = await client.post(
            "/grade/telecom",
            json={"sample": {"output_text": DONE}, "item": {"task_id": TASK}, "trace_id": trace},
        )
        assert graded.status_code == 200, graded.text
        assert graded.json()["score"] == 0.0, graded.text
