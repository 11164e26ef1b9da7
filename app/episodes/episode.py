"""A step and the end of an episode: a tool call through the one call service, `submit` as a grade.

Both front doors (OpenEnv, ORS) call these: a step is `ToolCallService.call` on the session's rollout
(validated, exactly-once, logged with the session's channel and run label), and `submit` grades with
the pack's grader through `GradingService.grade`, the path `POST /grade/<pack>` takes, so the grade is
stored and reviewed like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from app.calls.envelope import ToolCallEnvelope
from app.calls.service import SEND_TO_USER
from app.deps import AppState
from app.episodes.sessions import EpisodeSession, SessionStore
from app.errors import ServiceUnavailable, SparringError, StartupError, answer_to
from app.packs import Registry
from app.remote.runner import contained
from app.users.service import (
    SEND_TO_USER_ARG,
    SEND_TO_USER_DESCRIPTION,
    progress_of,
    restore,
    scenario_for,
    with_service_tools,
)
from sparring.loop import USER_KEY, ModelFailure
from sparring.usersim import UserReply

# How long a retried submit waits for the grade its first try is running, reading the session record
# every SUBMIT_POLL_SECONDS; past it, the retry is a 503 and the client sends it again.
SUBMIT_WAIT_SECONDS = 60.0
SUBMIT_POLL_SECONDS = 0.25
SUBMIT = "submit"  # the reserved terminal call: not a tool of any pack, never in a tool list
SUBMIT_ARG = "answer"
SUBMIT_DESCRIPTION = (
    "End the episode with your final answer: your final message to the user, as text. It is graded "
    "and the episode ends; no call is accepted after it."
)


class EpisodeFinished(SparringError):
    """A call or a submit after `submit` ended the episode."""

    status_code = 409
    code = "episode_finished"

    def __init__(self, message: str = "the episode has ended (submit was called)") -> None:
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class StepResult:
    """A step's answer: the output `POST /tools/<name>` gives on the same state, and whether it is an
    `Error: ...` the model made (`is_error`)."""

    output: str
    is_error: bool
    call_id: str
    outcome: str


def check_submit_is_free(registry: Registry) -> None:
    """Refuse to start when a pack defines a tool named like the reserved terminal call."""
    for pack, tools in registry.pack_tools.items():
        if SUBMIT in tools:
            raise StartupError(
                f"pack {pack!r} defines a tool named {SUBMIT!r}, the episode protocols' "
                "terminal call: rename the tool, or set SPARRING_ENV_PROTOCOLS to none"
            )


def _failure(services: AppState, exc: Exception) -> Exception:
    """What a front door maps: a SparringError as it is, a database or Redis error as its 503, a bug as
    it is (a 500)."""
    return answer_to(exc, services.settings.retry_after_seconds) or exc


def session_store(services: AppState) -> SessionStore:
    """The session records of the app's state store."""
    return SessionStore(services.store, ttl_seconds=services.settings.episode_ttl_seconds)


def tool_specs(registry: Registry, pack: str, *, user: bool = False) -> list[dict[str, Any]]:
    """The pack's tools as the protocols list them: exactly `name`, `description` and `input_schema`
    (`GET /tools?pack=`' `parameters`), in that order; `submit` is not among them. A name the pack
    shares with another enabled pack is listed too: an episode's calls go to its own pack's tools.
    With `user` (the server has a simulated user), `send_message_to_user` comes last."""
    specs = [
        {"name": spec.name, "description": spec.description, "input_schema": spec.parameters}
        for spec in registry.pack_tools.get(pack, {}).values()
    ]
    if user and SEND_TO_USER not in registry.pack_tools.get(pack, {}):
        argument = {"type": "string", "description": "Your message to the customer."}
        schema = {
            "type": "object",
            "properties": {SEND_TO_USER_ARG: argument},
            "required": [SEND_TO_USER_ARG],
        }
        specs.append({"name": SEND_TO_USER, "description": SEND_TO_USER_DESCRIPTION, "input_schema": schema})
    return specs


def grader_for(services: AppState, pack: str) -> str | None:
    """The grader of a pack's episodes: the one named after the pack, else the default, else none."""
    graders = services.grading.graders
    if pack in graders:
        return pack
    default = services.grading.default
    return default if default in graders else None


async def call_tool(
    services: AppState, session: EpisodeSession, name: str, arguments: Any, call_id: str
) -> StepResult:
    """One step: the call `name(arguments)` on the session's rollout, under `call_id` (a retry with the
    same id is replayed, not run again).

    Raises EpisodeFinished after `submit`, ServiceUnavailable (503) on an outage, ToolCrashed when the
    tool crashed; a model mistake is an answer (`is_error`), never an exception.
    """
    if session.done:
        raise EpisodeFinished
    if name == SEND_TO_USER and services.user is not None:
        return await message_user(services, session, arguments, call_id)
    envelope = ToolCallEnvelope(
        type="function_call",
        call_id=call_id,
        name=name,
        arguments=arguments,
        trace_id=session.trace_id,
        item=session.row or {},
    )
    try:
        answered = await services.call_service.call(
            envelope, path_name=None, run=session.run or None, channel=session.channel, pack=session.pack
        )
    except Exception as exc:
        failure = _failure(services, exc)
        if failure is exc:
            raise
        raise failure from exc
    await session_store(services).count_step(session)
    # Every answer but `ok` is an `Error: ...` (model_error, call_id_reused).
    return StepResult(
        output=answered.output.output,
        is_error=answered.outcome != "ok",
        call_id=call_id,
        outcome=answered.outcome,
    )


async def submit(
    services: AppState, session: EpisodeSession, answer: str, *, call_id: str | None = None
) -> float | None:
    """End the episode with `answer`: its reward, the pack grader's score (None without a grader).

    The grade is `POST /grade/<grader>`'s: sample `{"output_text": answer}` (with `ended_by` once the
    simulated user ended the conversation, as the loop's sample has it), item the session's row,
    the session's trace, stored with its flags. An outage (ServiceUnavailable) leaves the episode open
    for a retry; a grader that cannot grade (a config error, state gone) ends it and raises. A retry
    of the submit that ended the episode (the same `call_id`) gets its reward again; any other call
    after it raises EpisodeFinished; a retry while that submit is still grading waits for its reward
    (at most SUBMIT_WAIT_SECONDS, then ServiceUnavailable: send it again), and once that grade is
    presumed lost (its claim older than SUBMIT_LEASE_SECONDS) raises EpisodeFinished.
    """
    if session.done and call_id is not None and session.submit_call_id == call_id:
        return session.reward
    if session.done:
        raise EpisodeFinished
    sessions = session_store(services)
    deadline: float | None = None
    while not await sessions.claim_submit(session, call_id=call_id):
        # Another submit holds the claim. If it is this one's first try, still grading (ORS resumes a
        # dropped `/call` stream by sending it again), wait for its reward; if that try gives the claim
        # back (an outage, or a cancellation), this one claims it and grades; if that try's claim lapsed
        # (its worker stopped mid-grade and its give-back was lost), the episode has ended.
        current = await sessions.get(session.sid)
        if current is None or call_id is None:
            raise EpisodeFinished
        if current.done:
            if current.submit_call_id != call_id:
                raise EpisodeFinished
            session.done, session.reward, session.submit_call_id = True, current.reward, call_id
            return current.reward
        # No call id yet: the claim is being made (its count and its call id are two writes), so wait.
        if current.submit_call_id is not None and current.submit_call_id != call_id:
            raise EpisodeFinished
        if sessions.lapsed(current):
            raise EpisodeFinished  # its grade is presumed lost: the episode ends without a reward
        now = asyncio.get_running_loop().time()
        deadline = deadline if deadline is not None else now + SUBMIT_WAIT_SECONDS
        if now >= deadline:
            if current.submit_call_id is None:
                raise EpisodeFinished  # another submit claimed it and never said which
            raise ServiceUnavailable(
                "this submit is still being graded: send it again for its reward",
                services.settings.retry_after_seconds,
            )
        await asyncio.sleep(SUBMIT_POLL_SECONDS)
    grader = grader_for(services, session.pack)
    reward: float | None = None
    if grader is not None:
        sample: dict[str, Any] = {"output_text": answer}
        if session.user.get("ended"):
            # How the user ended the conversation, as the loop tells the grader: τ²'s graders score one
            # cut short (max_steps, too_many_errors) 0.
            sample["ended_by"] = session.user["ended"]
        try:
            result = await services.grading.grade(
                grader, sample, session.row or {}, session.trace_id, run=session.run or None
            )
        except Exception as exc:
            failure = _failure(services, exc)
            if isinstance(failure, ServiceUnavailable):
                await sessions.release_submit(session)
            else:
                await sessions.finish(session, None, call_id=call_id)
            if failure is exc:
                raise
            raise failure from exc
        except BaseException:
            # Cancelled mid-grade (a shutdown): the claim is given back for a retry to grade (if this
            # fails too, a retry waits for it until it lapses, SUBMIT_LEASE_SECONDS, then is refused).
            with contextlib.suppress(Exception):
                await asyncio.shield(sessions.release_submit(session))
            raise
        reward = result.score
    await sessions.finish(session, reward, call_id=call_id)
    return reward


async def message_user(
    services: AppState, session: EpisodeSession, arguments: Any, call_id: str
) -> StepResult:
    """The agent's message to the simulated user, answered with the user's reply (`_exchange`). The
    messages of one episode take turns in this worker, as the call service's user tool's do (a
    conversation is one message at a time): each reads the conversation the previous one left."""
    async with services.call_service.turn(f"{session.trace_id}\x00{session.pack}"):
        current = await session_store(services).get(session.sid)
        if current is not None and current.trace_id == session.trace_id:
            session.user = current.user
        return await _exchange(services, session, arguments, call_id)


async def _exchange(services: AppState, session: EpisodeSession, arguments: Any, call_id: str) -> StepResult:
    """The agent's message to the simulated user, answered with the user's reply (its own tool calls
    run in between, unseen, through the call service: logged on the channel `user`, ids `user_...`).
    A message the user cannot take, or a user model that fails, is an `Error: ...` the agent reads (the
    same message may be sent again: a failed exchange is kept only when the user's own calls ran in
    it, and the message sent again goes on from them); an outage of the state or the log during the
    user's own calls raises ServiceUnavailable (503), as any step's does, the calls that ran kept the
    same way."""
    # The user's replies by the call id of the message they answer: a retry under the same id (ORS
    # resumes a `/call` whose stream dropped with its `task_id`) gets its reply again, and the user
    # never hears that message twice.
    answers: dict[str, str] = session.user.get("answers") or {}
    if call_id in answers:
        return StepResult(output=answers[call_id], is_error=False, call_id=call_id, outcome="ok")
    message = arguments.get(SEND_TO_USER_ARG) if isinstance(arguments, dict) else None
    if not isinstance(message, str) or not message.strip():
        return _user_error(call_id, f"{SEND_TO_USER} takes one argument, {SEND_TO_USER_ARG!r}: your message")
    if session.user.get("ended"):
        return _user_error(call_id, f"the customer has ended the conversation ({session.user['ended']})")
    user = with_service_tools(
        contained(services.user, session.trace_id, what="the user model of episode"),
        services.call_service,
        pack=session.pack,
        run=session.run or None,
    )
    try:
        row = session.row or {}
        item = {key: value for key, value in row.items() if key != USER_KEY}
        scenario = scenario_for(services.registry, session.pack, row)
        conversation = user.start(scenario, item, session.trace_id) if user is not None else None
    except ValueError as exc:
        return _user_error(call_id, f"this task's user scenario is unusable: {exc}")
    if conversation is None:
        return _user_error(call_id, "this task has no simulated customer (its row has no user scenario)")
    unanswered = session.user.get("unanswered") or {}
    # The message sent again after the user failed while answering it, its own calls run: the user goes
    # on from them (a call made again would apply twice: a toggle would flip back).
    resuming = unanswered.get("message") == message
    restore(conversation, session.user, resuming=resuming)
    if conversation.exhausted and not resuming:
        reply = UserReply(text="", ended="max_steps")
    else:
        try:
            reply = await (conversation.resume() if resuming else conversation.reply(message))
        except (ModelFailure, ServiceUnavailable) as exc:
            # The user's calls ran: their effects are in the rollout's state, so the message sent again
            # goes on from them. After an outage, the step is its 503 (kept first, when the store can).
            progress = progress_of(conversation, call_id, message)
            if isinstance(exc, ServiceUnavailable):
                if progress is not None:
                    with contextlib.suppress(ServiceUnavailable):
                        await session_store(services).save_user(session, {**progress, "answers": answers})
                raise
            if progress is not None:
                await session_store(services).save_user(session, {**progress, "answers": answers})
            return _user_error(call_id, f"the customer could not answer ({exc}); send your message again")
    text = reply.text or f"(the conversation has ended: {reply.ended})"
    state = {
        "messages": conversation.messages,
        "steps": conversation.steps,
        "errors": conversation.errors,
        "ended": reply.ended,
        "answers": {**answers, call_id: text},
    }
    await session_store(services).save_user(session, state)
    await session_store(services).count_step(session)
    return StepResult(output=text, is_error=False, call_id=call_id, outcome="ok")


def _user_error(call_id: str, message: str) -> StepResult:
    return StepResult(output=f"Error: {message}", is_error=True, call_id=call_id, outcome="model_error")
