"""The server's simulated user: the model of SPARRING_USER_MODEL, reached through the remote rollouts'
guarded HTTP client, so it is held to the same egress rule (SPARRING_REMOTE_ALLOWED_HOSTS), answer cap
and connection pool as their model calls.

`build_user` returns None when no user model is set: rows with a user scenario then play as before
(the agent reads the row's one customer message). Whoever runs a rollout wraps the user's model with
`app.remote.runner.contained`, so that a failure reaches the caller in sparring's words, never the
endpoint's.

On the server the user's own tools (telecom's phone) run in process, `ServiceUserTools`: the call
service's path of `POST /user-tools/<name>` (validated, exactly-once, logged under the rollout's trace
on the channel `user`), each call id prefixed `user_` so that it never meets one of the agent's.

`UserToolConversations` answers the tool `send_message_to_user` (SPARRING_USER_TOOL, for tool-only
hosted loops): the call service runs it on its own path (`ToolCallService._converse`), the rollout's
conversation kept in the rollout's state, the answer in the call ledger like any other call's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import orjson
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from pydantic import ConfigDict, Field, create_model

from app.calls.envelope import ToolCallEnvelope
from app.calls.service import SEND_TO_USER, USER_CHANNEL, ConversationUnavailable, ToolCallService
from app.config import Settings
from app.db.session import Database
from app.errors import ServiceUnavailable, StartupError, ToolCrashed
from app.packs import Registry
from app.rollouts.store import StoredAnswer
from app.rollouts.transcripts import TranscriptRepository, keyed
from app.sdk import ToolSpec
from sparring.conversation import parse_conversation
from sparring.http import Attempt, Retry, call_with_retries
from sparring.loop import USER_KEY, FunctionCall, ModelFailure, ToolResult
from sparring.policies import ChatPolicy, DeadlinePolicy
from sparring.usersim import (
    USER_ROLE,
    ScenarioError,
    SimulatedUser,
    UserConversation,
    UserReply,
    listed_tools,
    settled,
)
from sparring.wire import INFRA_ERROR, TOOL_CRASH, USER_CALL_PREFIX

log = logging.getLogger("sparring.users")


SEND_TO_USER_ARG = "message"
SEND_TO_USER_DESCRIPTION = (
    "Send a message to the customer and read their reply. The customer may end the conversation: "
    "their reply then holds ###STOP###, ###TRANSFER### or ###OUT-OF-SCOPE###."
)
TRANSCRIPT_SOURCE = "user_tool"


def build_user(settings: Settings, http: DefaultAsyncHttpxClient) -> SimulatedUser | None:
    """The simulated user the settings describe, on `http` (the guarded model client); None when
    SPARRING_USER_MODEL is unset."""
    if settings.user_model is None:
        return None
    key = settings.user_api_key.get_secret_value() if settings.user_api_key is not None else None
    client = AsyncOpenAI(
        base_url=settings.user_base_url,
        api_key=key or "none",
        http_client=http,
        timeout=settings.user_timeout_seconds,
        max_retries=2,
    )
    model = ChatPolicy(client, settings.user_model, temperature=settings.user_temperature)
    return SimulatedUser(
        model=DeadlinePolicy(model, settings.user_timeout_seconds),
        name=settings.user_model,
        max_steps=settings.user_max_steps,
    )


def scenario_for(registry: Registry, pack: str | None, item: Mapping[str, Any]) -> Any:
    """What the simulated user of a row plays: the row's `user_simulator`, else its pack's scenario
    loader's (by the row's task_id); None when neither gives one. Without `pack`, the one enabled pack
    with a scenario loader, if there is exactly one."""
    if item.get(USER_KEY) is not None:
        return item[USER_KEY]
    if pack is None:
        loaders = [name for name, p in registry.packs.items() if p.scenario_loader is not None]
        pack = loaders[0] if len(loaders) == 1 else None
    served = registry.packs.get(pack) if pack is not None else None
    if served is None or served.scenario_loader is None:
        return None
    return served.scenario_loader(registry.resources.get(served.name), item)


class ServiceUserTools:
    """The user's tools in process, on the call service's path of `POST /user-tools/<name>`.

    With `retry` (a remote rollout, which discards on an outage), an outage or a crash is tried again,
    then becomes the result's failure; without it (a request's own step, whose caller retries), the
    ServiceUnavailable or ToolCrashed goes up to be answered 503 or 500."""

    def __init__(
        self,
        calls: ToolCallService,
        *,
        pack: str | None,
        run: str | None,
        retry: Retry | None = None,
    ) -> None:
        self.calls = calls
        self.pack = pack
        self.run = run
        self.retry = retry

    def schemas(self, scenario: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The tools the scenario lists, else the user tools of the rollout's pack. Without a pack, a
        scenario that lists none has none (a retail or airline customer's), whatever the other enabled
        packs' users have (telecom's phone)."""
        listed = listed_tools(scenario)
        if listed or "tools" in scenario or self.pack is None:
            return listed
        return [spec.function_tool() for spec in self.calls.registry.user_tools.get(self.pack, {}).values()]

    async def call(self, call: FunctionCall, *, trace_id: str, item: Mapping[str, Any]) -> ToolResult:
        envelope = ToolCallEnvelope(
            type="function_call",
            call_id=USER_CALL_PREFIX + call.call_id,
            name=call.name,
            arguments=call.arguments,
            trace_id=trace_id,
            item=dict(item),
        )

        async def answer() -> str:
            answered = await self.calls.call(
                envelope, path_name=None, run=self.run, channel=USER_CHANNEL, pack=self.pack, user=True
            )
            return answered.output.output

        if self.retry is None:
            return ToolResult(call=call, output=await answer())

        async def attempt() -> Attempt[str]:
            try:
                return Attempt(value=await answer())
            except ServiceUnavailable as exc:
                return Attempt(
                    failure=f"{INFRA_ERROR}: {exc.message}", kind=INFRA_ERROR, retry_after_s=exc.retry_after
                )
            except ToolCrashed as exc:
                return Attempt(failure=f"{TOOL_CRASH}: {exc.message}", kind=TOOL_CRASH)

        return await call_with_retries(call, self.retry, attempt, started=time.perf_counter())


def with_service_tools(
    user: SimulatedUser | None,
    calls: ToolCallService,
    *,
    pack: str | None,
    run: str | None,
    retry: Retry | None = None,
) -> SimulatedUser | None:
    """`user` with its own tools run in process (`ServiceUserTools`)."""
    if user is None:
        return None
    return replace(user, tools=ServiceUserTools(calls, pack=pack, run=run, retry=retry))


# --- send_message_to_user: the tool of tool-only loops ----------------------------------------------


async def _never_called(message: str) -> str:  # the call service answers the tool itself
    raise RuntimeError(f"{SEND_TO_USER} is answered by the call service")


_Message = create_model(
    "SendMessageToUser",
    __config__=ConfigDict(extra="forbid"),
    message=(str, Field(description="Your message to the customer.")),
)


def user_tool_spec(pack: str) -> ToolSpec:
    """`send_message_to_user` as a tool of `pack`."""
    return ToolSpec(
        name=SEND_TO_USER,
        fn=_never_called,
        description=SEND_TO_USER_DESCRIPTION,
        arguments=_Message,
        context_param=None,
        defaults={},
        mutates=True,  # it changes the rollout's conversation
        is_async=True,
        pack=pack,
    )


def offer_user_tool(registry: Registry) -> list[str]:
    """Add `send_message_to_user` to every enabled pack with user scenarios (a scenario loader); the
    packs it was added to. StartupError when such a pack has a tool of that name."""
    offered = []
    for name, pack in registry.packs.items():
        if pack.scenario_loader is None:
            continue
        if SEND_TO_USER in registry.pack_tools[name]:
            raise StartupError(
                f"pack {name!r} has a tool named {SEND_TO_USER!r}, the simulated user's tool "
                "(SPARRING_USER_TOOL): rename the tool, or unset SPARRING_USER_TOOL"
            )
        registry.pack_tools[name] = {**registry.pack_tools[name], SEND_TO_USER: user_tool_spec(name)}
        offered.append(name)
    registry.index()
    return offered


class UserToolConversations:
    """The answers of `send_message_to_user`: the user's reply to the agent's message, its own tool
    calls run in between (logged on the channel `user`, unseen by the agent).

    The conversation so far is the rollout's (`state`, read and written by the call service), so any
    worker and any retry continue it. A reply that ends the conversation holds its stop token; later
    messages answer an `Error: ...`. A user model that fails is an outage (ServiceUnavailable, 503 with
    Retry-After): the platform retries the call, then discards the rollout, rather than training the
    policy on a customer who did not answer. After each exchange the rollout's conversation is stored
    (source `user_tool`), best effort.
    """

    def __init__(
        self, user: SimulatedUser, registry: Registry, database: Database | None, *, wait_seconds: float
    ) -> None:
        self.user = user
        self.registry = registry
        self.database = database
        self.wait_seconds = wait_seconds  # how long a retry waits for the attempt still running

    async def exchange(
        self,
        calls: ToolCallService,
        pack: str,
        message: str,
        *,
        trace_id: str,
        call_id: str | None,
        item: Mapping[str, Any],
        run: str | None,
        state: Mapping[str, Any] | None,
    ) -> tuple[StoredAnswer, dict[str, Any] | None]:
        """The answer to the agent's `message`, and the conversation to keep (None: unchanged)."""
        from app.remote.runner import contained  # the runner imports this module's tools

        if not message.strip():
            return _error(f"{SEND_TO_USER} needs a message for the customer"), None
        state = state or {}
        if state.get("ended"):
            return _error(f"the customer has ended the conversation ({state['ended']})"), None
        tools_item = {key: value for key, value in item.items() if key != USER_KEY}
        try:
            scenario = scenario_for(self.registry, pack, item)
            user = with_service_tools(
                contained(self.user, trace_id, what="the user model of rollout"), calls, pack=pack, run=run
            )
            assert user is not None
            conversation = user.start(scenario, tools_item, trace_id)
        except ScenarioError as exc:
            return _error(f"this task's user scenario is unusable: {exc}"), None
        if conversation is None:
            return _error("this task has no simulated customer (no user scenario for its row)"), None
        unanswered = state.get("unanswered") or {}
        # The retry of an exchange whose user made calls of its own, then failed: it goes on from them
        # (a turn of calls cut short included: `resume` runs its calls again under their ids).
        resuming = call_id is not None and unanswered == {"call_id": call_id, "message": message}
        restore(conversation, state, resuming=resuming)
        if conversation.exhausted and not resuming:
            conversation.messages.append({"role": "assistant", "content": message})
            reply = UserReply(text="", ended="max_steps")
        else:
            try:
                reply = await (conversation.resume() if resuming else conversation.reply(message))
            except (ModelFailure, ServiceUnavailable) as exc:
                why = exc.message if isinstance(exc, ServiceUnavailable) else str(exc)
                raise ConversationUnavailable(
                    f"the simulated user could not answer: {why}",
                    progress=progress_of(conversation, call_id, message),
                ) from exc
        # The agent's message is the call's: the transcript pairs it with its answer.
        asked = next(m for m in reversed(conversation.messages) if m.get("role") == "assistant")
        asked["call_id"] = call_id
        output = reply.text or f"(the conversation has ended: {reply.ended})"
        asked["output"] = output
        kept = {
            "messages": conversation.messages,
            "steps": conversation.steps,
            "errors": conversation.errors,
            "ended": reply.ended,
        }
        await self._store_transcript(trace_id, kept)
        return StoredAnswer(output=output, outcome="ok"), kept

    async def _store_transcript(self, trace_id: str, state: Mapping[str, Any]) -> None:
        if self.database is None:
            return
        try:
            conversation = keyed(parse_conversation(transcript_of(state)))
            size = len(orjson.dumps(conversation))
            async with self.database.session(write=True) as session:
                await TranscriptRepository(session).put(trace_id, conversation, size)
        except Exception as exc:  # an outage loses the transcript, never the answer
            log.warning("the conversation of %s was not stored: %s", trace_id, exc)


def transcript_of(state: Mapping[str, Any]) -> dict[str, Any]:
    """A tool-only rollout's conversation with its user (sparring.conversation's shape): each of the
    agent's `send_message_to_user` calls, the user's reply (`simulated_user`), and the call's output
    (the reply, or how the conversation ended)."""
    return {"model": None, "source": TRANSCRIPT_SOURCE, "messages": _with_outputs(state)}


def _with_outputs(state: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    pending: tuple[str, str] | None = None

    def close() -> None:
        nonlocal pending
        if pending is not None:
            messages.append({"role": "tool", "call_id": pending[0], "content": pending[1]})
            pending = None

    for message in state.get("messages", []):
        role = message.get("role")
        if role == "assistant":
            close()
            call_id = str(message.get("call_id") or "(none)")
            arguments = orjson.dumps({SEND_TO_USER_ARG: message.get("content")}).decode()
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"call_id": call_id, "name": SEND_TO_USER, "arguments": arguments}],
                }
            )
            pending = (call_id, str(message.get("output") or ""))
        elif role == USER_ROLE and message.get("content") and not message.get("tool_calls"):
            messages.append({"role": USER_ROLE, "content": message["content"]})
    close()
    return messages


def restore(conversation: UserConversation, state: Mapping[str, Any], *, resuming: bool) -> None:
    """The conversation as the rollout's stored `state` left it, for the agent's next message: whole when
    a failed exchange is resumed (its last turn of calls runs again under their ids), else without a last
    turn whose calls got no results (`settled`), and the agent's message counted, as τ²'s orchestrator
    counts it."""
    kept = state.get("messages", [])
    conversation.messages = [dict(m) for m in kept] if resuming else settled(kept)
    conversation.steps = int(state.get("steps", 0))
    conversation.errors = int(state.get("errors", 0))
    if not resuming:
        conversation.count()


def progress_of(conversation: UserConversation, call_id: str | None, message: str) -> dict[str, Any] | None:
    """The conversation of an exchange that failed, when the user made calls of its own in it (their
    effects may be in the rollout's state; a last turn whose calls were cut short is kept, for the
    retry to run them again under their ids); None when nothing happened that a retry should not do
    again."""
    messages = [dict(m) for m in conversation.messages]
    asked = max(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    if not any(m.get("role") == USER_ROLE and m.get("tool_calls") for m in messages[asked:]):
        return None
    return {
        "messages": messages,
        "steps": conversation.steps,
        "errors": conversation.errors,
        "ended": None,
        "unanswered": {"call_id": call_id, "message": message} if call_id is not None else None,
    }


def _error(message: str) -> StoredAnswer:
    return StoredAnswer(output=f"Error: {message}", outcome="model_error")
