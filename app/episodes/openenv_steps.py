"""OpenEnv episodes: what a reset, a tool step and `submit` do, for both of OpenEnv's transports.

The WebSocket (`/ws`) and OpenEnv's JSON-RPC (`/mcp`) share these, so a session's steps act on one
rollout whichever way they arrive. The answers are shaped as openenv 0.10's clients read them: a
tool's result is `{"content", "structured_content", "data", "is_error"}` (the client's `call_tool`
returns `data`), and a failure that is not the model's is `{"error_type", "message"}`, exactly those
two keys (the client's `ToolError` forbids others).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from app.deps import AppState
from app.episodes import episode
from app.episodes.episode import SUBMIT, SUBMIT_ARG, EpisodeFinished
from app.episodes.sessions import EpisodeSession
from app.episodes.tasks import TaskApiError, load_task_row
from app.errors import ServiceUnavailable, SparringError, ToolCrashed
from app.rollouts.identity import JSON_DEPTH_MAX, RUN_MAX, fit, nested_deeper_than, trace_key

log = logging.getLogger(__name__)

CHANNEL = "openenv"  # the channel of the calls, and the run label when the client sends none


class EpisodeRefused(Exception):
    """A request the session cannot take (no episode yet, ended, closed, a bad reset): the client's
    mistake, answered as an error frame (WS) or a JSON-RPC error (`/mcp`), never as a 5xx."""

    def __init__(self, message: str, *, code: str = "SESSION_ERROR") -> None:
        super().__init__(message)
        self.message = message
        self.code = code  # an openenv `WSErrorCode`


class ResetData(BaseModel):
    """A reset's `data`: a task as `{"split", "index"}` or `{"task": row}`, and an optional
    `episode_id` (a label, part of the new rollout's trace id). Other keys (`seed`, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    split: str | None = None
    index: int | None = None
    task: dict[str, Any] | None = None
    episode_id: str | None = None


@dataclass
class StepAnswer:
    """One `call_tool` step: the tool's `result` or a non-model `error`, and the episode's end."""

    result: dict[str, Any] | None
    error: dict[str, str] | None = None
    reward: float | None = None
    done: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)

    def observation(self, tool_name: str) -> dict[str, Any]:
        return {"tool_name": tool_name, "result": self.result, "error": self.error}


def run_label(value: str | None) -> str:
    """The run label of a session: the `X-Sparring-Run` header, else the channel's name."""
    return fit(value, RUN_MAX) if value else CHANNEL


def tool_result(text: str, *, is_error: bool = False, structured: Any = None) -> dict[str, Any]:
    return {
        "content": [{"type": "text", "text": text}],
        "structured_content": structured,
        "data": text,
        "is_error": is_error,
    }


def _error(error_type: str, message: str) -> dict[str, str]:
    return {"error_type": error_type, "message": message}


async def session_of(services: AppState, pack: str, sid: str | None) -> EpisodeSession:
    """The OpenEnv session `sid` of this mount's pack (EpisodeRefused when there is none)."""
    session = await episode.session_store(services).get(sid or "")
    if session is None or session.channel != CHANNEL or (session.pack and session.pack != pack):
        raise EpisodeRefused(f"no open session {sid!r} on this environment (closed or expired?)")
    return session


async def open_session(services: AppState, run: str) -> EpisodeSession:
    """A new session without an episode (its first reset starts one)."""
    created = await episode.session_store(services).create(
        pack="", trace_id="", row=None, channel=CHANNEL, run=run
    )
    if created is None:  # a fresh uuid4 already taken: not in practice
        raise EpisodeRefused("could not open a session")
    return created


async def _task_of(services: AppState, pack: str, data: ResetData) -> dict[str, Any]:
    by_index = data.split is not None or data.index is not None
    if (data.task is None) == (not by_index):
        raise EpisodeRefused(
            'reset needs a task: data {"split", "index"} or {"task": row}', code="VALIDATION_ERROR"
        )
    if data.task is not None:
        if nested_deeper_than(data.task):
            raise EpisodeRefused(
                f"the task nests more than {JSON_DEPTH_MAX} levels deep", code="VALIDATION_ERROR"
            )
        return data.task
    if data.split is None or data.index is None:
        raise EpisodeRefused('reset by index needs both "split" and "index"', code="VALIDATION_ERROR")
    return await load_task_row(services.registry, pack, data.split, data.index)


async def reset(services: AppState, pack: str, session: EpisodeSession, raw: Any, run: str) -> EpisodeSession:
    """Start a new rollout on the session, always on fresh state: trace `trace_openenv_<hex>`, or
    `trace_openenv_<episode_id>_<12 hex>` when the client labels the episode (the label finds it in the
    review pages; a reset with an earlier episode's id, or two sessions given one id, never share a
    rollout)."""
    try:
        data = ResetData.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        raise EpisodeRefused(f"bad reset data: {exc.errors()[0]['msg']}", code="VALIDATION_ERROR") from exc
    try:
        row = await _task_of(services, pack, data)
    except TaskApiError as exc:  # unknown split, index out of range
        raise EpisodeRefused(exc.message, code="VALIDATION_ERROR") from exc
    session.pack, session.row, session.run = pack, row, run
    # With a label, 12 random hex digits (48 bits) keep its episodes apart and leave it 100 characters
    # before the trace id is shortened (its head kept, a hash of the whole after it).
    fresh = f"{data.episode_id}_{uuid.uuid4().hex[:12]}" if data.episode_id else uuid.uuid4().hex
    session.trace_id = trace_key(f"trace_openenv_{fresh}")
    session.done, session.reward, session.step_count, session.user = False, None, 0, {}
    if not await episode.session_store(services).save(session):
        raise EpisodeRefused("the session was closed")
    return session


def reset_observation(session: EpisodeSession) -> dict[str, Any]:
    """The reset's answer: the task's prompt (no `tools` or `tool_name` key: the client dispatches on
    them)."""
    row = session.row or {}
    return {
        "observation": {
            "messages": row.get("messages", []),
            "task_id": row.get("task_id"),
            "trace_id": session.trace_id,
        },
        "reward": None,
        "done": False,
        "metadata": {"trace_id": session.trace_id},
    }


def state_of(session: EpisodeSession) -> dict[str, Any]:
    trace = session.trace_id or None
    return {
        "episode_id": trace,
        "step_count": session.step_count,
        "trace_id": trace,
        "done": session.done,
        "reward": session.reward,
    }


async def act(
    services: AppState, session: EpisodeSession, name: str, arguments: Any, call_id: str | None = None
) -> StepAnswer:
    """One `call_tool`: a tool through the call service, or `submit`, which grades and ends.

    `call_id` is the client's own id of the call (`given_call_id`), as on the tool routes: a step
    retried under it after a `transport_error` (whose call may have been applied) is answered from the
    ledger. Without one, each step is a new call."""
    if not session.trace_id:
        raise EpisodeRefused("no episode yet: send reset first")
    if session.done:
        raise EpisodeRefused(EpisodeFinished().message)
    if name == SUBMIT:
        return await _submit(services, session, arguments)
    metadata: dict[str, Any] = {"trace_id": session.trace_id}
    call_id = call_id or f"openenv_{uuid.uuid4().hex}"
    metadata["call_id"] = call_id
    try:
        step = await episode.call_tool(services, session, name, arguments, call_id)
    except EpisodeFinished as exc:
        raise EpisodeRefused(exc.message) from exc
    except ToolCrashed as exc:
        return StepAnswer(result=None, error=_error("execution_error", exc.message), metadata=metadata)
    except ServiceUnavailable as exc:
        return StepAnswer(result=None, error=_error("transport_error", exc.message), metadata=metadata)
    return StepAnswer(result=tool_result(step.output, is_error=step.is_error), metadata=metadata)


def given_call_id(holder: Any, key: str) -> str | None:
    """The client's id of a call, `holder[key]` (a step's `metadata["call_id"]`, a JSON-RPC call's
    `_meta["sparring/call_id"]`): None when absent, EpisodeRefused when not a non-empty string."""
    given = holder.get(key) if isinstance(holder, dict) else None
    if given is None:
        return None
    if not isinstance(given, str) or not given:
        raise EpisodeRefused(f"{key!r} must be a non-empty string: the call's id", code="VALIDATION_ERROR")
    return given


async def _submit(services: AppState, session: EpisodeSession, arguments: Any) -> StepAnswer:
    metadata: dict[str, Any] = {"trace_id": session.trace_id}
    answer = arguments.get(SUBMIT_ARG) if isinstance(arguments, dict) else None
    if not isinstance(answer, str) or set(arguments) != {SUBMIT_ARG}:
        text = f"Error: {SUBMIT} takes one argument, {SUBMIT_ARG!r}: your final answer as a string."
        return StepAnswer(result=tool_result(text, is_error=True), metadata=metadata)
    try:
        reward = await episode.submit(services, session, answer)
    except EpisodeFinished as exc:
        raise EpisodeRefused(exc.message) from exc
    except ServiceUnavailable as exc:
        return StepAnswer(result=None, error=_error("transport_error", exc.message), metadata=metadata)
    except SparringError as exc:  # the grader could not grade: the episode ends without a reward
        message = exc.message
    except Exception as exc:
        log.exception("submit of %s crashed", session.trace_id)
        message = f"the grader failed: {type(exc).__name__}"
    else:
        summary = {"reward": reward, "done": True}
        text = f"Episode ended. Reward: {reward}" if reward is not None else "Episode ended (no grader)."
        return StepAnswer(
            result=tool_result(text, structured=summary), reward=reward, done=True, metadata=metadata
        )
    return StepAnswer(result=None, error=_error("execution_error", message), done=True, metadata=metadata)
