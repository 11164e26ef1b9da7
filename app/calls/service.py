"""Answering a tool call: resolve, validate, deduplicate, run under the rollout's state, log, answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

import anyio.to_thread
import orjson
from pydantic import BaseModel, ValidationError

from app.calls.envelope import ToolCallEnvelope, ToolCallOutput
from app.calls.log_writer import CallLogWriter, CallRecord
from app.db.models import REPLAYED
from app.errors import ServiceUnavailable, ToolCrashed
from app.metrics import Metrics
from app.packs import Registry
from app.rollouts.identity import (
    CALL_ID_MAX,
    JSON_DEPTH_MAX,
    RUN_MAX,
    call_key,
    fit,
    item_key,
    nested_deeper_than,
    trace_key,
)
from app.rollouts.store import (
    CONVERSATIONS,
    CallStart,
    PackChanges,
    RolloutMeta,
    RolloutStore,
    StoredAnswer,
    Ticket,
)
from app.sdk import RolloutState, ToolContext, ToolError, ToolSpec, ToolUnavailable
from app.sdk.tool import describe_validation_error
from app.telemetry import Tracing
from sparring.wire import CALL_ID_REUSED, json_bytes, sorted_json

log = logging.getLogger(__name__)

# CALL_ID_REUSED (sparring.wire): the outcome of a call whose call_id already answered a different call:
# 200 with an `Error: ...` output, logged with its own arguments (never deduplicated), flagged for review.
# How long shutdown waits for voids still under way (each tries its UPDATE three times, 5 s at most).
_CORRECTIONS_GRACE_SECONDS = 20.0
_VOID_RETRY_MAX_SECONDS = 10.0  # the longest wait between two background tries of a void
USER_CHANNEL = "user"  # the call-log channel of a simulated user's tool calls


def call_digest(tool: str, arguments: Mapping[str, Any]) -> str:
    """What makes two calls the same call: the tool and its arguments, key order and spacing aside."""
    canonical = sorted_json(arguments, default=repr)
    return hashlib.blake2b(tool.encode() + b"\x00" + canonical, digest_size=16).hexdigest()


def truncate_output(output: str, cap: int) -> str:
    """Keep outputs far below the trainer's 1 MB limit, with a marker the model can see."""
    encoded = output.encode()
    if len(encoded) <= cap:
        return output
    marker = f"\n…[output truncated: {{cut}} of {len(encoded)} bytes cut]"
    keep = max(0, cap - len(marker.format(cut=len(encoded))) - 4)
    head = encoded[:keep].decode(errors="ignore")
    return head + marker.format(cut=len(encoded) - len(head.encode()))


def _default(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"cannot serialize {type(value).__name__}")


def serialize_result(result: Any) -> str:
    if isinstance(result, str):
        return result
    return json_bytes(result, default=_default, non_str_keys=True).decode()


@dataclass(frozen=True, slots=True)
class AnsweredCall:
    """The output a tool call was answered and how it ended (`ok`, or `model_error` and
    `call_id_reused`: an `Error: ...` the model reads)."""

    output: ToolCallOutput
    outcome: str


@dataclass
class _Call:
    envelope: ToolCallEnvelope
    tool: str
    # The ids as the store and the log both key them, normalized once (`trace_key`, `call_key`).
    trace_id: str
    call_id: str | None
    arguments_text: str
    run: str | None
    channel: str
    item_key: str | None
    started_at: datetime
    started: float
    # This attempt's own name in the log: its row, and the void of that row, are found by it.
    attempt_id: str = field(default_factory=lambda: os.urandom(16).hex())  # 128 random bits
    # The answer's log record and its commit, queued before the store finished the call (see
    # ToolCallService._finish), and whether that record was then voided: the answer was not kept.
    record: CallRecord | None = None
    logged: asyncio.Future[None] | None = None
    voided: bool = False
    # The answer is the ledger's, stored by an earlier attempt of this very call: logged `replayed`.
    replayed: bool = False


SEND_TO_USER = "send_message_to_user"  # the tool answered by `Conversations` (SPARRING_USER_TOOL)


class ConversationUnavailable(ServiceUnavailable):
    """The user could not answer (its model or its own calls failed): a 503. `progress` is the
    conversation to keep all the same when the user's own calls ran before the failure (their effects
    are in the rollout's state: the retry continues from them rather than asking for them again)."""

    def __init__(self, message: str, progress: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.progress = progress


class Conversations(Protocol):
    """The answers of `send_message_to_user` (app.users.service.UserToolConversations)."""

    wait_seconds: float

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
    ) -> tuple[StoredAnswer, dict[str, Any] | None]: ...


@dataclass(eq=False, kw_only=True)
class ToolCallService:
    """The one entry of a tool call, whichever way it arrives (HTTP, MCP, the rollout runner): `call`
    (the answer and its outcome).

    Built once by the lifespan (`app_state(app).call_service`); a caller parses its envelope
    (`ToolCallEnvelope`), the run label and its channel, and gets the `function_call_output` back, or
    a `SparringError` (ToolCrashed 500, ServiceUnavailable 503) to render in its own protocol.
    """

    registry: Registry
    store: RolloutStore
    log_writer: CallLogWriter
    worker: str
    max_output_bytes: int
    tool_timeout: float
    metrics: Metrics
    tracing: Tracing | None = None  # None: tracing is off (app/telemetry.py)
    retry_after: int = 2  # the Retry-After of the 503s it raises itself (SPARRING_RETRY_AFTER_SECONDS)
    # Answers `send_message_to_user` when SPARRING_USER_TOOL offers it (set by the lifespan).
    conversations: Conversations | None = None
    # The labelled metric children, looked up once per (tool, outcome) instead of on every call.
    _counters: dict[tuple[str, str], Any] = field(default_factory=dict, init=False, repr=False)
    _latencies: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _tool_loggers: dict[str, logging.Logger] = field(default_factory=dict, init=False, repr=False)
    # Voids under way (see _finish).
    _voiding: set[asyncio.Future[None]] = field(default_factory=set, init=False, repr=False)
    _closing: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    # The messages to a rollout's simulated user waiting for their turn: [lock, holders and waiters].
    _turns: dict[str, list[Any]] = field(default_factory=dict, init=False, repr=False)
    _active: int = field(default=0, init=False, repr=False)  # calls in flight in this worker

    async def call(
        self,
        envelope: ToolCallEnvelope,
        *,
        path_name: str | None,
        run: str | None,
        channel: str = "rft",
        pack: str | None = None,
        user: bool = False,
    ) -> AnsweredCall:
        """Answer one call whichever way it arrived (HTTP tool route, MCP): validate, deduplicate, run
        under the rollout's state, log durably, answer; outages raise ServiceUnavailable, crashes
        ToolCrashed. `pack` (an enabled pack) looks the tool up among that pack's tools only; `user`
        among the simulated user's tools (`Pack.user_tool`) instead of the agent's."""
        call = _Call(
            envelope=envelope,
            tool=(path_name or envelope.name or "")[:128],
            trace_id=trace_key(envelope.trace_id) if envelope.trace_id else f"trace_anon_{uuid.uuid4().hex}",
            call_id=call_key(envelope.call_id),
            arguments_text=_arguments_text(envelope.arguments),
            run=fit(run, RUN_MAX) if run else None,
            channel=channel,
            item_key=item_key(envelope.item),
            started_at=datetime.now(UTC),
            started=time.perf_counter(),
        )
        outcome = "infra_error"
        self.metrics.in_flight.inc()
        self._active += 1
        try:
            try:
                answer = await self._answer(call, path_name, pack, user)
            except ToolCrashed as exc:
                outcome = "tool_crash"
                # The caller gets a short message; the exception's own text (which may name hosts,
                # paths or data) goes to the call log and the server log only.
                cause = exc.__cause__
                detail = f"{exc.message}: {type(cause).__name__}: {cause}" if cause else exc.message
                with contextlib.suppress(ServiceUnavailable):
                    await self.log_writer.write(self._record(call, None, "tool_crash", detail, 500))
                raise
            except ServiceUnavailable as exc:
                if not call.voided:  # a voided record already logs this attempt as its infra_error
                    self.log_writer.submit(self._record(call, None, "infra_error", exc.message, 503))
                raise
            except Exception as exc:
                # A bug in sparring, answered with the app's own 500: logged like any failure, so every
                # call the trainer got an answer to is in the log.
                if not call.voided:
                    reason = f"not answered: {type(exc).__name__}"
                    with contextlib.suppress(ServiceUnavailable):
                        await self.log_writer.write(self._record(call, None, "infra_error", reason, 500))
                raise
            if call.record is None or call.logged is None:
                call.record = self._answered(call, answer)
                call.logged = self.log_writer.enqueue(call.record, alone=self._active == 1)
            try:
                await call.logged
            except ServiceUnavailable:
                # The commit failed with an unknown fate (the connection dropped during it): the row
                # may be there, and the answer is not sent. Void it in the background (the 503 goes
                # out now); the retry replays the stored answer and logs the replay as the answer.
                self._track(self._void(call.logged, call.record, "call log commit failed", 503))
                raise
            outcome = answer.outcome
        finally:
            self._active -= 1
            self.metrics.in_flight.dec()
            # Names the model made up are counted together: a label per invented name would grow forever.
            tool = call.tool if self.registry.served(call.tool) else "(unknown)"
            counter = self._counters.get((tool, outcome))
            if counter is None:
                counter = self._counters[(tool, outcome)] = self.metrics.tool_calls.labels(tool, outcome)
            counter.inc()
            latency = self._latencies.get(tool)
            if latency is None:
                latency = self._latencies[tool] = self.metrics.tool_latency.labels(tool)
            latency.observe(time.perf_counter() - call.started)
            if self.tracing is not None:
                self.tracing.tool_call(call, outcome)
        return AnsweredCall(
            ToolCallOutput(call_id=envelope.call_id, id=envelope.id, output=answer.output), answer.outcome
        )

    async def call_user_tool(
        self,
        pack: str | Any,
        name: str,
        arguments: Mapping[str, Any],
        *,
        trace_id: str,
        call_id: str | None = None,
        item: Mapping[str, Any] | None = None,
        run: str | None = None,
    ) -> AnsweredCall:
        """A simulated user's call of one of `pack`'s user tools (a pack name or a `Pack`), under the
        rollout `trace_id`: the same path as an agent's call (exactly-once by `call_id`, the lock, the
        log), logged on the channel `user`."""
        envelope = ToolCallEnvelope(
            name=name, arguments=dict(arguments), trace_id=trace_id, call_id=call_id, item=dict(item or {})
        )
        pack_name = pack if isinstance(pack, str) else pack.name
        return await self.call(
            envelope, path_name=name, run=run, channel=USER_CHANNEL, pack=pack_name, user=True
        )

    def _answered(self, call: _Call, answer: StoredAnswer) -> CallRecord:
        error = answer.output if answer.outcome != "ok" else None
        outcome = REPLAYED if call.replayed else answer.outcome
        return self._record(call, answer.output, outcome, error, 200)

    def _record(
        self, call: _Call, output: str | None, outcome: str, error: str | None, status: int
    ) -> CallRecord:
        ended = datetime.now(UTC)
        return CallRecord(
            attempt_id=call.attempt_id,
            trace_id=call.trace_id,
            call_id=call.call_id,
            request_id=fit(call.envelope.id, CALL_ID_MAX) if call.envelope.id else None,
            tool=call.tool or "(none)",
            arguments=call.arguments_text,
            output=output,
            outcome=outcome,
            error=_encodable(error),
            status_code=status,
            started_at=call.started_at,
            ended_at=ended,
            latency_ms=(time.perf_counter() - call.started) * 1000,
            worker=self.worker,
            run=call.run,
            item_key=call.item_key,
            channel=call.channel,
        )

    def _tools(self, pack: str | None, user: bool) -> Mapping[str, ToolSpec]:
        if user:
            return self.registry.all_user_tools() if pack is None else self.registry.user_tools.get(pack, {})
        return self.registry.tools if pack is None else self.registry.pack_tools[pack]

    def _resolve(
        self, call: _Call, path_name: str | None, pack: str | None, user: bool = False
    ) -> ToolSpec | StoredAnswer:
        body_name = call.envelope.name
        if (
            path_name
            and body_name
            and body_name != path_name
            and body_name.removeprefix("functions.") != path_name
        ):
            return _model_error(
                f"this call names the tool {body_name!r} but was sent to the URL of the tool {path_name!r}; "
                "call each tool at its own URL"
            )
        name = path_name or (body_name or "").removeprefix("functions.")
        tools = self._tools(pack, user)
        spec = tools.get(name) if name else None
        if spec is not None:
            return spec
        available = ", ".join(sorted(tools)) or "none"
        if not name:
            return _model_error(f"the call does not name a tool. Available tools: {available}")
        if pack is None and not user and name in self.registry.shared:
            routes = " or ".join(self.registry.qualified_routes(name))
            return _model_error(
                f"the tool {name!r} is served by several packs ({', '.join(self.registry.shared[name])}); "
                f"call it at its pack's route: {routes}"
            )
        return _model_error(f"unknown tool {name!r}. Available tools: {available}")

    async def _answer(self, call: _Call, path_name: str | None, pack: str | None, user: bool) -> StoredAnswer:
        spec = self._resolve(call, path_name, pack, user)
        if isinstance(spec, StoredAnswer):
            return spec
        if nested_deeper_than(call.envelope.item):
            return _model_error(f"the call's item nests more than {JSON_DEPTH_MAX} levels deep")
        bound = _bind(spec, call.envelope.arguments)
        if isinstance(bound, StoredAnswer):
            return bound
        raw, kwargs = bound
        if self.conversations is not None and spec.name == SEND_TO_USER and not user:
            return await self._converse(self.conversations, spec, raw, kwargs, call)

        call_id = call.call_id
        stateful = spec.context_param is not None or spec.mutates
        if call_id is None and not stateful:
            # Nothing to claim, lock or read: a call without a call_id is not deduplicated.
            return (await self._run(spec, kwargs, call, None))[0]
        digest = call_digest(spec.name, raw)  # before the claim: nothing between it and the `try` raises
        began = await self.store.begin(
            CallStart(
                call.trace_id,
                call_id,
                lock=spec.mutates,
                meta=RolloutMeta(run=call.run, item_key=call.item_key, now=time.time()) if stateful else None,
                load_changes=spec.context_param is not None,
                wait=self.tool_timeout + 5,
            )
        )
        if isinstance(began, StoredAnswer):
            return self._replay(began, digest, call)
        try:
            writes: PackChanges = {}
            if spec.mutates and began.graded:
                answer = _model_error(
                    "this rollout has already been graded; tools that change state no longer accept calls"
                )
            else:
                answer, writes = await self._run(spec, kwargs, call, began)
            await self._finish(call, began, writes, replace(answer, call=digest))
        except BaseException:
            with contextlib.suppress(ServiceUnavailable):
                await self.store.abort(began)
            raise
        return answer

    def _replay(self, stored: StoredAnswer, digest: str, call: _Call) -> StoredAnswer:
        """A call whose call_id the ledger already answered: that answer if it is a retry of the call."""
        if stored.call and stored.call != digest:
            # Not a retry: another call under a call_id already answered. Replaying the first answer
            # would pair these arguments with an output they did not produce.
            return StoredAnswer(
                output=f"Error: call_id {call.call_id!r} was already used for a different call "
                "(another tool or other arguments); give each new call a new call_id",
                outcome=CALL_ID_REUSED,
            )
        self.metrics.ledger_replays.inc()
        call.replayed = True
        return stored  # a retry: the identical answer, without running the tool again

    async def _converse(
        self,
        conversations: Conversations,
        spec: ToolSpec,
        raw: dict[str, Any],
        kwargs: dict[str, Any],
        call: _Call,
    ) -> StoredAnswer:
        """`send_message_to_user`: claimed in the ledger like any call (a retry replays the reply), the
        conversation read from and written to the rollout's state, but without the rollout's lock
        while the user answers (its own tool calls take it, call by call). Messages of one rollout to
        its user take turns in this worker (a conversation is one message at a time): the next one
        reads the conversation the previous one left."""
        digest = call_digest(spec.name, raw)  # before the claim: nothing between it and the `try` raises
        async with self.turn(f"{call.trace_id}\x00{spec.pack}"):
            began = await self.store.begin(
                CallStart(
                    call.trace_id,
                    call.call_id,
                    lock=False,
                    meta=RolloutMeta(run=call.run, item_key=call.item_key, now=time.time()),
                    load_changes=True,
                    wait=conversations.wait_seconds,
                )
            )
            if isinstance(began, StoredAnswer):
                return self._replay(began, digest, call)
            try:
                writes: PackChanges = {}
                if began.graded:
                    answer = _model_error("this rollout has already been graded; the conversation is over")
                else:
                    kept = began.changes.get(CONVERSATIONS, {}).get(spec.pack, {}).get("conversation")
                    answer, state = await conversations.exchange(
                        self,
                        spec.pack,
                        str(kwargs.get("message", "")),
                        trace_id=call.trace_id,
                        call_id=call.call_id,
                        item=call.envelope.item,
                        run=call.run,
                        state=kept,
                    )
                    if state is not None:
                        writes = {CONVERSATIONS: {spec.pack: {"conversation": state}}}
                await self._finish(call, began, writes, replace(answer, call=digest))
            except ConversationUnavailable as exc:
                if exc.progress is not None:  # kept before the claim is given up, so a retry reads it
                    with contextlib.suppress(ServiceUnavailable):
                        await self._keep_conversation(call, spec.pack, exc.progress)
                with contextlib.suppress(ServiceUnavailable):
                    await self.store.abort(began)
                raise
            except BaseException:
                with contextlib.suppress(ServiceUnavailable):
                    await self.store.abort(began)
                raise
            return answer

    @contextlib.asynccontextmanager
    async def turn(self, key: str) -> AsyncIterator[None]:
        """Hold `key`'s turn in this worker: one holder at a time, the others waiting in order (a
        rollout's messages to its simulated user, keyed by trace and pack, here and in episodes)."""
        turn = self._turns.get(key)
        if turn is None:
            turn = self._turns[key] = [asyncio.Lock(), 0]
        turn[1] += 1
        try:
            async with turn[0]:
                yield
        finally:
            turn[1] -= 1
            if not turn[1]:
                del self._turns[key]

    async def _keep_conversation(self, call: _Call, pack: str, state: dict[str, Any]) -> None:
        """Write a rollout's conversation without answering a call (no ledger entry, no lock)."""
        meta = RolloutMeta(run=call.run, item_key=call.item_key, now=time.time())
        ticket = await self.store.begin(CallStart(call.trace_id, None, meta=meta))
        assert isinstance(ticket, Ticket)
        writes: PackChanges = {CONVERSATIONS: {pack: {"conversation": state}}}
        await self.store.finish(ticket, writes, StoredAnswer(output="", outcome="ok"))

    async def _finish(self, call: _Call, began: Ticket, writes: PackChanges, answer: StoredAnswer) -> None:
        """Store the answer (and the call's writes) while its log record commits, not one after the other.

        Both must be done before the answer is sent; the caller awaits the record (`call.logged`) after
        this. A log that failed leaves the answer stored: the retry replays it and logs the replay. A
        store that failed, after the record may have committed, voids the attempt's row before the 503
        goes out (a void the database refuses then goes on in the background until it goes in), so the
        log does not show an answer that was not sent; the retry's attempt, replayed or run again, is
        logged in its own row and reads as the call's answer (app/db/call_log.py).
        """
        record = call.record = self._answered(call, answer)
        call.logged = self.log_writer.enqueue(record, alone=self._active == 1)
        try:
            await self.store.finish(began, writes, answer)
        except BaseException as exc:
            logged, call.logged, call.voided = call.logged, None, True
            if isinstance(exc, ServiceUnavailable):
                reason, status = exc.message, 503
            else:
                reason, status = f"not answered: {type(exc).__name__}", 500
            voiding = self._track(self._void(logged, record, reason, status))
            if not isinstance(exc, asyncio.CancelledError):
                # Before the error goes out, so a retry's record never meets this one unvoided; a
                # cancelled request leaves the void running.
                await asyncio.shield(voiding)
            raise

    def _track(self, void: Awaitable[None]) -> asyncio.Future[None]:
        """Run a void, kept until it is done even if nobody waits for it (see aclose)."""
        voiding = asyncio.ensure_future(void)
        self._voiding.add(voiding)
        voiding.add_done_callback(self._voiding.discard)
        return voiding

    async def _void(self, logged: asyncio.Future[None], record: CallRecord, reason: str, status: int) -> None:
        try:
            with contextlib.suppress(ServiceUnavailable):
                await logged  # a commit that failed has an unknown fate: void what may be there
            await self.log_writer.void(record, reason=reason, status_code=status)
        except ServiceUnavailable:
            # The caller's 503 goes out now; the void goes on in the background until the database
            # takes it (or the server stops), so the row does not keep showing an answer never sent.
            log.warning(
                "call log: the answer to call %s of rollout %s was not sent and its row (attempt %s) "
                "could not be voided yet; retrying in the background",
                record.call_id,
                record.trace_id,
                record.attempt_id,
            )
            self._track(self._void_later(record, reason, status))
        except Exception:  # a bug here must not turn the caller's 503 into a 500
            log.exception("call log: voiding the unsent answer to call %s failed", record.call_id)

    async def _void_later(self, record: CallRecord, reason: str, status: int) -> None:
        """Retry a void until it goes in: backing off up to `_VOID_RETRY_MAX_SECONDS`, at once when the
        server starts closing (aclose waits for these for a while)."""
        delay = 0.5
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), timeout=delay)
            try:
                await self.log_writer.void(record, reason=reason, status_code=status)
            except ServiceUnavailable:
                delay = min(delay * 2, _VOID_RETRY_MAX_SECONDS)
                continue
            except Exception:
                log.exception("call log: voiding the unsent answer to call %s failed", record.call_id)
                return
            log.info(
                "call log: voided the unsent answer to call %s of rollout %s", record.call_id, record.trace_id
            )
            return

    async def aclose(self) -> None:
        """Let the voids still running finish (for a while), before the writer stops."""
        self._closing.set()
        if not self._voiding:
            return
        _, late = await asyncio.wait(list(self._voiding), timeout=_CORRECTIONS_GRACE_SECONDS)
        for voiding in late:
            log.error("call log: a void was still running at shutdown; its row may show an unsent answer")
            voiding.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    async def _run(
        self, spec: ToolSpec, kwargs: dict[str, Any], call: _Call, began: Ticket | None
    ) -> tuple[StoredAnswer, PackChanges]:
        state: RolloutState | None = None
        if began is not None and spec.context_param is not None:
            try:
                base = spec.base()
            except Exception as exc:
                log.exception("pack %s could not load its base state", spec.pack)
                raise ServiceUnavailable(
                    f"pack {spec.pack!r} could not load its data: {exc}", retry_after=self.retry_after
                ) from exc
            state = RolloutState(base, began.changes.get(spec.pack, {}), writable=spec.mutates)
        if spec.context_param is not None:
            assert state is not None
            logger = self._tool_loggers.get(spec.pack)
            if logger is None:
                logger = self._tool_loggers[spec.pack] = logging.getLogger(f"sparring.tools.{spec.pack}")
            adapter = logging.LoggerAdapter(
                logger,
                {"trace_id": call.trace_id, "call_id": call.call_id},
            )
            kwargs = {
                **kwargs,
                spec.context_param: ToolContext(
                    trace_id=call.trace_id,
                    call_id=call.call_id,
                    tool_name=spec.name,
                    item=call.envelope.item,
                    state=state,
                    logger=adapter,
                    deadline=time.monotonic() + self.tool_timeout,
                    run=call.run,
                    resources=self.registry.resources.get(spec.pack),
                    anonymous=not call.envelope.trace_id,
                ),
            }
        try:
            if spec.is_async:
                result = await _within(spec.fn(**kwargs), self.tool_timeout)
            elif spec.inline:
                result = spec.fn(**kwargs)  # quick by declaration: no thread hop (see Pack.tool)
            else:
                result = await asyncio.wait_for(
                    anyio.to_thread.run_sync(lambda: spec.fn(**kwargs)), self.tool_timeout
                )
            # Text no UTF-8 encoder writes (a lone surrogate) fails here, as the tool's crash.
            output = truncate_output(serialize_result(result), self.max_output_bytes)
            if state is not None and state.writes:
                # Every store keeps what orjson writes (Redis stores it so): a record it cannot write (a
                # set, a key that is no string, an integer beyond 64 bits) fails here, as the tool's
                # crash, on every backend, not later in one store only.
                orjson.dumps(state.writes)
        except ToolError as exc:
            return _model_error(exc.message), {}
        except TimeoutError as exc:
            raise ServiceUnavailable(
                f"tool {spec.name!r} did not finish within {self.tool_timeout:g} s",
                retry_after=self.retry_after,
            ) from exc
        except ToolUnavailable as exc:
            message = _encodable(exc.message)
            log.warning("tool %s unavailable (trace_id=%s): %s", spec.name, call.trace_id, message)
            raise ServiceUnavailable(
                f"tool {spec.name!r} is unavailable: {message}", retry_after=self.retry_after
            ) from exc
        except ServiceUnavailable:
            raise
        except Exception as exc:
            log.exception("tool %s crashed (trace_id=%s call_id=%s)", spec.name, call.trace_id, call.call_id)
            raise ToolCrashed(
                f"tool {spec.name!r} crashed ({type(exc).__name__}); the traceback is in the server log",
                tool=spec.name,
            ) from exc
        answer = StoredAnswer(output=output, outcome="ok")
        writes = {spec.pack: state.writes} if state is not None and state.writes else {}
        return answer, writes


def _expire(task: asyncio.Task[Any], expired: list[bool]) -> None:
    expired[0] = True
    task.cancel()


async def _within(call: Awaitable[Any], seconds: float) -> Any:
    """Await `call`, raising TimeoutError if it takes longer than `seconds`.

    What `asyncio.timeout` does for this one use (cancel the task at the deadline, turn that
    cancellation into TimeoutError, let any other cancellation through), with one timer handle and
    none of its state machine: every tool call pays for it (`bench/instructions.py` measures that).
    """
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    cancelling = task.cancelling()
    expired = [False]
    timer = loop.call_at(loop.time() + seconds, _expire, task, expired)
    try:
        return await call
    except asyncio.CancelledError:
        if expired[0] and task.uncancel() <= cancelling:
            raise TimeoutError from None
        raise
    finally:
        timer.cancel()


_JSON_TYPES = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


# An `Error: ...` output's cap: what a mistake says (the names and values it echoes, a tool's message)
# never needs more, and a hostile request that echoes itself cannot grow the answer or the log row.
MODEL_ERROR_BYTES = 16 * 1024


def _model_error(message: str) -> StoredAnswer:
    return StoredAnswer(output=truncate_output(f"Error: {message}", MODEL_ERROR_BYTES), outcome="model_error")


def _encodable(text: str | None) -> str | None:
    """A tool's error text as an answer and the log can carry it: what UTF-8 cannot encode (a lone
    surrogate in the message of a tool's exception, from a name decoded with `surrogateescape`) written
    as '?'. Left as it is, the answer could not be written, and its log record failed the commit of the
    whole batch, every other call in it with it."""
    if text is None or text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode(errors="replace").decode()
    return text


def _arguments_text(arguments: Any) -> str:
    if arguments is None:
        return ""
    if isinstance(arguments, str):
        return arguments
    try:
        # Arguments sent as an object (as MCP sends them) may hold an integer beyond 64 bits.
        return json_bytes(arguments, default=str).decode()
    except (TypeError, RecursionError, ValueError):
        # Nested deeper than orjson writes; the call is answered an Error.
        return f"(arguments not logged: nested more than {JSON_DEPTH_MAX} levels deep)"


def _bind(spec: ToolSpec, arguments: Any) -> tuple[dict[str, Any], dict[str, Any]] | StoredAnswer:
    """The arguments as sent (a JSON string or an object) and as the tool's parameters.

    Mistakes become outputs the model can act on.
    """
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        raw: Any = {}
    elif isinstance(arguments, str):
        try:
            raw = orjson.loads(arguments)
        except orjson.JSONDecodeError as exc:
            return _model_error(
                f"the arguments for {spec.name!r} are not valid JSON ({exc}); send a JSON object"
            )
    else:
        raw = arguments
    if not isinstance(raw, dict):
        kind = _JSON_TYPES.get(type(raw), type(raw).__name__)
        return _model_error(f"the arguments for {spec.name!r} must be a JSON object, not {kind}")
    if nested_deeper_than(raw):
        return _model_error(
            f"the arguments for {spec.name!r} nest more than {JSON_DEPTH_MAX} levels deep; send flatter JSON"
        )
    try:
        values = spec.bind(raw)
    except ValidationError as exc:
        return _model_error(f"invalid arguments for {spec.name!r}: {describe_validation_error(exc)}")
    # What the model sent (a tool's own default, math.inf say, is the tool's to write).
    unwritable = _unwritable_number([values.get(name) for name, given in raw.items() if given is not None])
    if unwritable is not None:
        # Lax validation reads "999...9" as an int of any size and "NaN", "Infinity" or "1e400" as a
        # float no JSON store (orjson, Redis, Postgres's bigint) writes back (the memory store kept it):
        # the model is told, instead of the call failing after the tool or its state changing by store.
        return _model_error(f"invalid arguments for {spec.name!r}: {unwritable}")
    return raw, values


_INT64 = range(-(2**63), 2**63)


def _unwritable_number(value: Any) -> str | None:
    """What makes `value` (bound arguments: dicts, lists, tuples, sets, models, dataclasses) unwritable
    as JSON: an int outside 64 bits, or a float that is not finite; None when it holds neither."""
    stack = [value]
    while stack:
        node = stack.pop()
        if type(node) is int:
            if node not in _INT64:
                return "an integer beyond 64 bits (-2**63 to 2**63 - 1)"
        elif type(node) is float:
            if not math.isfinite(node):
                return f"{node} is not a finite number"
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple | set | frozenset):
            stack.extend(node)
        elif isinstance(node, BaseModel):
            stack.extend(node.__dict__.values())
            stack.extend((node.__pydantic_extra__ or {}).values())
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            stack.extend(getattr(node, item.name) for item in dataclasses.fields(node))
    return None
