"""Episode sessions: which rollout a protocol session drives, kept in the app's state store.

A session record lives beside the rollouts in the state store (Redis, or memory for the embedded
default), so any worker answers any request of a session. Each field has one writer: `save` the
episode (pack, trace, row), `count_step` the step counter, `finish` the end; a step never rewrites
`done`, so a call running while `submit` ends the episode cannot reopen it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from app.rollouts.store import RecordWrite, RolloutStore

# Session ids come from clients (ORS's X-Session-ID); longer ones name no session.
SID_MAX = 128
# How long a retry of a submit waits, across its tries, for the grade its first try claimed: past it that
# grade is presumed lost (its worker stopped mid-grade, or the give-back of its claim was lost in an
# outage) and the retry is told the episode has ended, never made to wait for ever. Longer than any grade
# takes (a model judge's timeout is 60 s by default). Taking the claim over instead could grade twice:
# the first try may still be running and would then end, or give back, a claim that is no longer its own.
SUBMIT_LEASE_SECONDS = 300.0


@dataclass
class EpisodeSession:
    """One protocol session: the rollout (`trace_id`) it drives, the task row, and how it ended.

    `pack` is empty until the session has a task (ORS opens a session before `/create` gives it one).
    """

    sid: str
    pack: str
    trace_id: str
    row: dict[str, Any] | None
    done: bool
    reward: float | None
    step_count: int
    channel: str
    run: str
    # The call id of the `submit` that claimed the end of the episode: a retry of it waits for the
    # grade (while it runs) or is answered its reward again (once it is done).
    submit_call_id: str | None = None
    # When that submit claimed it (time.time()): a claim older than SUBMIT_LEASE_SECONDS is presumed lost
    # (its worker stopped mid-grade), and a retry of the same submit stops waiting for it.
    submit_at: float | None = None
    # The simulated user's side of the conversation (`send_message_to_user`): its messages, the steps
    # taken and how the user ended it; empty until the agent first writes to the user.
    user: dict[str, Any] = field(default_factory=dict)

    @property
    def started(self) -> bool:
        return bool(self.pack)


def _key(sid: str) -> str:
    return f"episode:{sid}"


def _episode_fields(session: EpisodeSession) -> dict[str, str]:
    return {
        "pack": session.pack,
        "trace_id": session.trace_id,
        "row": orjson.dumps(session.row).decode(),
        "channel": session.channel,
        "run": session.run,
    }


def _end_fields(done: bool, reward: float | None) -> dict[str, str]:
    return {"done": "1" if done else "0", "reward": orjson.dumps(reward).decode()}


def _session(sid: str, fields: dict[str, str]) -> EpisodeSession:
    row = orjson.loads(fields["row"]) if fields.get("row") else None
    reward = orjson.loads(fields["reward"]) if fields.get("reward") else None
    return EpisodeSession(
        sid=sid,
        pack=fields.get("pack", ""),
        trace_id=fields.get("trace_id", ""),
        row=row if isinstance(row, dict) else None,
        done=fields.get("done") == "1",
        reward=float(reward) if isinstance(reward, int | float) else None,
        step_count=int(fields.get("steps", "0")),
        channel=fields.get("channel", ""),
        run=fields.get("run", ""),
        submit_call_id=fields.get("submit_call") or None,
        submit_at=float(fields["submit_at"]) if fields.get("submit_at") else None,
        user=_user_of(fields.get("user")),
    )


def _user_of(raw: str | None) -> dict[str, Any]:
    user = orjson.loads(raw) if raw else None
    return user if isinstance(user, dict) else {}


class SessionStore:
    """Session records over the app's `RolloutStore`; each expires `ttl_seconds` after its last use."""

    def __init__(self, store: RolloutStore, *, ttl_seconds: float) -> None:
        self.store = store
        self.ttl = ttl_seconds

    async def create(
        self,
        *,
        pack: str,
        trace_id: str,
        row: dict[str, Any] | None,
        channel: str,
        run: str,
        sid: str | None = None,
    ) -> EpisodeSession | None:
        """A new session (`sid`: a fresh uuid4 unless given); None if a session `sid` already exists."""
        session = EpisodeSession(
            sid=sid or str(uuid.uuid4()),
            pack=pack,
            trace_id=trace_id,
            row=row,
            done=False,
            reward=None,
            step_count=0,
            channel=channel,
            run=run,
        )
        fields = _episode_fields(session) if pack else {"trace_id": trace_id, "channel": channel, "run": run}
        fields |= {**_end_fields(False, None), "steps": "0", "submits": "0"}
        created = await self.store.record_put(RecordWrite(_key(session.sid), fields, self.ttl, create=True))
        return session if created else None

    async def get(self, sid: str) -> EpisodeSession | None:
        """The session `sid` (None when unknown, closed or expired); reading it keeps it alive."""
        if not sid or len(sid) > SID_MAX:
            return None
        fields = await self.store.record_get(_key(sid), ttl_seconds=self.ttl)
        return _session(sid, fields) if fields is not None else None

    async def save(self, session: EpisodeSession) -> bool:
        """Write the session's episode (pack, trace, row, labels) and its end state, step count reset to
        `session.step_count`; False when the session no longer exists (closed or expired)."""
        fields = {
            **_episode_fields(session),
            **_end_fields(session.done, session.reward),
            "steps": str(session.step_count),
            "submits": "1" if session.done else "0",
            "user": orjson.dumps(session.user).decode() if session.user else "",
        }
        return await self.store.record_put(RecordWrite(_key(session.sid), fields, self.ttl))

    async def save_user(self, session: EpisodeSession, user: dict[str, Any]) -> None:
        """Keep the simulated user's side of the conversation (after each of its answers)."""
        session.user = user
        fields = {"user": orjson.dumps(user).decode()}
        await self.store.record_put(RecordWrite(_key(session.sid), fields, self.ttl))

    async def start(self, session: EpisodeSession) -> bool:
        """Give a session made without a task its episode: only once (False if it has one already or
        no longer exists)."""
        return await self.store.record_put(
            RecordWrite(_key(session.sid), _episode_fields(session), self.ttl, unless_field="pack")
        )

    async def count_step(self, session: EpisodeSession) -> None:
        count = await self.store.record_add(_key(session.sid), "steps", 1, ttl_seconds=self.ttl)
        if count is not None:
            session.step_count = count

    async def claim_submit(self, session: EpisodeSession, *, call_id: str | None = None) -> bool:
        """Whether this is the session's one `submit` (concurrent submits: only one grades). The claim
        keeps `call_id`, so a retry of this submit waits for its reward instead of being refused; a
        refused claim gives back what it took, so a claim released after an outage can be made again."""
        count = await self.store.record_add(_key(session.sid), "submits", 1, ttl_seconds=self.ttl)
        if count != 1:
            if count is not None:
                await self.release_submit(session)
            return False
        if call_id is not None:
            await self._lease(session, call_id)
        return True

    def lapsed(self, held: EpisodeSession) -> bool:
        """Whether the claim `held` (read from the store) is older than SUBMIT_LEASE_SECONDS: the grade it
        was made for is presumed lost (its worker stopped mid-grade, or its give-back was lost)."""
        return held.submit_at is not None and time.time() - held.submit_at > SUBMIT_LEASE_SECONDS

    async def _lease(self, session: EpisodeSession, call_id: str) -> None:
        session.submit_call_id, session.submit_at = call_id, time.time()
        fields = {"submit_call": call_id, "submit_at": repr(session.submit_at)}
        await self.store.record_put(RecordWrite(_key(session.sid), fields, self.ttl))

    async def release_submit(self, session: EpisodeSession) -> None:
        """A submit that could not grade (an outage): the next one may try again."""
        await self.store.record_add(_key(session.sid), "submits", -1, ttl_seconds=self.ttl)

    async def finish(
        self, session: EpisodeSession, reward: float | None, *, call_id: str | None = None
    ) -> None:
        """Mark the episode done with its reward (None: not graded, or ended by an error) and the call id
        of the submit that ended it."""
        session.done, session.reward, session.submit_call_id = True, reward, call_id
        fields = {**_end_fields(True, reward), "submit_call": call_id or ""}
        await self.store.record_put(RecordWrite(_key(session.sid), fields, self.ttl))

    async def close(self, sid: str) -> bool:
        """End the session (its rollout, log and state stay); whether it existed."""
        if not sid or len(sid) > SID_MAX:
            return False
        return await self.store.record_delete(_key(sid))
