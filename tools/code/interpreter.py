"""A persistent Python interpreter per rollout: the `python` tool's notebook-like kernel.

Each rollout (trace_id) gets its own sandboxed process (`Sandbox.open_session`: the same bwrap, rlimits,
memory cgroup and no network as a run) running `harness_interpreter.py`; the server talks to it with
length-prefixed JSON frames over its stdin and a pipe of its own. A worker holds at most `max_live`
interpreters, stops those idle for `idle_seconds` and, at the cap, the least recently used one.

Which interpreter a rollout's state belongs to is recorded in the rollout's state (`MARKER`): the
worker, a session id and the number of cells whose answers were stored. A call whose rollout names
another session (another worker, a restarted one, an interpreter that was stopped, or one that ran a
cell whose answer was never stored) is never run against the wrong state: it starts a new interpreter
and says so.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import socket
import struct
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from tools.code.memory import process_identity
from tools.code.sandbox import (
    Limits,
    Output,
    RunResult,
    Sandbox,
    SandboxUnavailable,
    Session,
    harness_source,
    parse_report,
    report_cap,
    under,
)

log = logging.getLogger("sparring.packs.code.interpreter")
T = TypeVar("T")

MARKER = ("interpreter", "session")  # the rollout-state record naming its interpreter
RESTARTED = "the interpreter was restarted; earlier state is lost"
MAX_FRAME_BYTES = 16 * 1024 * 1024  # a frame's ceiling; a cell's answer is capped by its limits (`frame_cap`)
SMALL_FRAME_BYTES = 64 * 1024  # the driver's hello and a check's verdict
FRAME_SLACK_BYTES = (
    256 * 1024
)  # a cell's answer past its base64 outputs and files: its value, traceback, keys
THREAD_DECODE_BYTES = 256 * 1024  # a frame larger than this is decoded in a thread, off the event loop
# An entry point's answer that the server relays to a grade's judge, as JSON text (the driver is told it and
# keeps to it; a cell that writes its own frames does not, so it is held here too): over it, the judge gets
# a failed call, never a text it would need more memory to decode than it has.
MAX_CALL_REPLY_CHARS = 4 * 1024 * 1024
MAX_TOTAL = 1 << 62  # an output's size as the driver counted it
TEXT_CHARS = 64 * 1024  # a cell's value or traceback, a check's error, as the server keeps it
READY_SECONDS = 15.0  # bwrap's setup and the driver's start
LOST_REASONS_KEPT = 4096
CHECK_GRACE_SECONDS = 10.0  # past a check's own limit: the driver's stopping and restoring
ENDING_GRACE_SECONDS = 1.0  # for an interpreter whose pipe closed to exit, so its status is known
# After a request's answer, the interpreter's processes are stopped until its next request: what a cell left
# running (a thread, a child process) gets this long, then waits for the rollout's next call.
FREEZE_AFTER_SECONDS = 0.05


class InterpreterStopped(Exception):
    """The interpreter ended while running a cell (or was stopped at the time limit): its state is lost."""


class InterpreterGone(Exception):
    """A grade asked for the rollout's interpreter state, and this worker holds no interpreter with it."""


class StoppedByItsCode(InterpreterGone):
    """The rollout's interpreter is gone because the rollout's own code stopped it (a cell that ran too
    long, exited, crashed it or outgrew its memory; or a grade's check in it): a failed check, not a lost
    state."""


@dataclass(frozen=True)
class Lost:
    """Why a rollout's interpreter was stopped, kept for its next call or grade; `session` is that
    interpreter's id when the rollout's own code stopped it (a grade then scores the failure)."""

    reason: str
    session: str | None = None


@dataclass(frozen=True)
class CheckVerdict:
    """What a grade's check in the interpreter answered (`Interpreter.check`)."""

    passed: bool
    error: str | None
    timed_out: bool
    not_placed: tuple[tuple[str, str], ...] = ()  # the rollout's final files the check could not be given


class JudgeFailed(OSError):
    """The grade's judge (a fresh interpreter running the hidden tests) did not start or answer: an
    outage of the grader, never the rollout's doing."""


class InterpreterBusy(Exception):
    """Every interpreter of the worker is running a cell: none can make room for a new one."""


@dataclass(frozen=True)
class InterpreterLimits:
    idle_seconds: float = 600.0
    max_live: int = 16
    cell_seconds: float = 30.0
    cpu_seconds: int = 600  # CPU time of an interpreter's whole life
    run: Limits = field(default_factory=Limits)
    spares: int = 0  # interpreters started ahead of any rollout: a rollout's first call takes one


@dataclass(frozen=True)
class CellResult:
    stdout: bytes
    stdout_total: int
    stderr: bytes
    stderr_total: int
    value: str | None
    exception: str | None
    files: RunResult  # the workspace after the cell, as a run's result carries it
    # The rollout's files the driver could not place, as (path, why).
    not_placed: tuple[tuple[str, str], ...] = ()


UNKNOWN = "\udc80"  # a file's text never equal to a rollout's (which always encodes): content unknown


class Interpreter:
    """One rollout's live interpreter."""

    def __init__(self, session: Session, worker: str, now: float) -> None:
        self.session = session
        self.id = uuid.uuid4().hex
        self.worker = worker
        self.cells = 0  # cells whose answers the rollout stored (its marker counts them too)
        self.last_used = now
        self.lock = asyncio.Lock()
        self.known: dict[str, str] = {}  # the workspace's files as the interpreter last had them
        self.noted: dict[str, str] = {}  # files it holds that the rollout could not keep, by digest
        self.broken = False
        self.stored = False  # a call came with the rollout's marker of its cells: their answers were stored
        self._frame_size: int | None = None  # the size of a frame whose body is still to be read

    def marker(self) -> dict[str, Any]:
        return {"worker": self.worker, "session": self.id, "cells": self.cells}

    def matches(self, marker: Mapping[str, Any] | None) -> bool:
        if self.broken or marker is None:
            return False
        return marker.get("session") == self.id and marker.get("cells") == self.cells

    def changes(self, files: Mapping[str, str]) -> dict[str, str | None]:
        """What to send so the interpreter's workspace holds `files` (the rollout's)."""
        changes: dict[str, str | None] = {
            path: text for path, text in files.items() if self.known.get(path) != text
        }
        changes.update({path: None for path in self.known if path not in files})
        return changes

    def settle(
        self,
        files: Mapping[str, str],
        sent: Mapping[str, str | None],
        stale: frozenset[str],
        refused: Mapping[str, str | None],
        unseen: frozenset[str] = frozenset(),
        aside: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        """After a cell: the interpreter holds the rollout's `files`, but for what `sent` it could not place
        (`stale`: sent again with the next cell), the cell's changes the rollout refused (`refused`: the
        rollout's versions put back with the next cell), paths its walk did not see (`unseen`: whatever is
        there, and the rollout's files under them, replaced by the rollout's or deleted) and the rollout's
        files it holds in a version the rollout could not keep (`aside`: the rollout's put back)."""
        known = dict(files)
        for path in stale:
            if sent.get(path) is None:
                known[path] = UNKNOWN  # a deletion not made: asked again
            else:
                known.pop(path, None)  # a file not written: sent again
        for path, change in refused.items():
            if change is None:
                known.pop(path, None)  # it deleted one of the rollout's files: sent again
            else:
                known[path] = change  # it wrote this: the rollout's version (or a deletion) is sent
        for path in unseen:
            known[path] = UNKNOWN
        for path in files:
            if under(path, unseen):
                known[path] = UNKNOWN
        for path in aside:
            if path in files:
                known[path] = UNKNOWN
        self.known = known

    async def ready(self) -> None:
        await asyncio.wait_for(self._receive(SMALL_FRAME_BYTES), READY_SECONDS)

    async def cell(self, code: str, files: Mapping[str, str | None], limits: InterpreterLimits) -> CellResult:
        """Run `code` after applying `files`; InterpreterStopped if it ends or outlives the limit."""
        request_id = uuid.uuid4().hex
        request = {
            "id": request_id,
            "code": code,
            "files": dict(files),
            "output_bytes": limits.run.output_bytes,
            "max_files": limits.run.max_files,
            "max_bytes": limits.run.max_workspace_bytes,
            "seconds": limits.cell_seconds,  # the driver gives up showing a value before the call's end
        }
        body = json.dumps(request).encode("utf-8")
        try:
            # The request's sending counts in the call's time too: a driver that stopped reading (a cell's
            # thread stopped it) cannot hold the call past its limit.
            async with asyncio.timeout(limits.cell_seconds):  # no task of its own, as wait_for starts
                await self.session.send(struct.pack(">I", len(body)) + body)
                answer = await self._answer_to(request_id, frame_cap(limits))
            result = _cell_result(answer)
            self.session.freeze_later(FREEZE_AFTER_SECONDS)
            return result
        except TimeoutError as exc:
            raise InterpreterStopped(
                f"the code ran longer than {limits.cell_seconds:g} seconds (the wall-clock limit of a call): "
                "the interpreter was stopped and its state is lost"
            ) from exc
        except Exception as exc:
            # The driver ended, or answered what no driver answers (a cell can write on its frame pipe):
            # either way the interpreter is stopped, and the model is told so.
            self.broken = True
            raise InterpreterStopped(await self._why_ended()) from exc
        except BaseException:
            # Cancelled mid-cell (the call's own deadline): the cell may still run, so no later request
            # may read its answer. Killed now; the pool removes it at the rollout's next call.
            self.broken = True
            self.session.kill()
            raise

    async def check(
        self, job: Mapping[str, Any], seconds: float, files: Mapping[str, str | None]
    ) -> CheckVerdict:
        """Run a grade's check in a fork of this interpreter (its namespace as the cells left it), `files`
        (`changes` to the rollout's final workspace) placed first; the workspace is put back afterwards.
        InterpreterStopped if the interpreter ends meanwhile, or its workspace could not be put back (it
        is then stopped: the rollout's files stay as the state has them, and no later call runs against a
        changed box)."""
        request_id = uuid.uuid4().hex
        body = json.dumps(
            {"id": request_id, "check": dict(job), "seconds": seconds, "files": dict(files)}
        ).encode("utf-8")
        async with self._grading():
            async with asyncio.timeout(seconds + CHECK_GRACE_SECONDS):
                await self.session.send(struct.pack(">I", len(body)) + body)
                answer = await self._answer_to(request_id, SMALL_FRAME_BYTES)
            passed, error, timed_out = answer["passed"], answer["error"], answer["timed_out"]
            if not isinstance(passed, bool) or not isinstance(timed_out, bool):
                raise TypeError("passed and timed_out must be booleans")
            if not (error is None or isinstance(error, str)):
                raise TypeError("error must be text")
            restored = answer["restored"] is True
            not_placed = _not_placed(answer.get("not_placed"))
        self._restored_or_stopped(restored)
        return CheckVerdict(
            passed=passed,
            error=None if error is None else plain_text(error),
            timed_out=timed_out,
            not_placed=not_placed,
        )

    async def send_frame(self, message: Mapping[str, Any]) -> None:
        body = json.dumps(message).encode("utf-8")
        await self.session.send(struct.pack(">I", len(body)) + body)

    async def judged(
        self, judge: Interpreter, job: Mapping[str, Any], seconds: float, files: Mapping[str, str | None]
    ) -> CheckVerdict:
        """A grade's hidden tests run by `judge` (an interpreter no cell ever ran in) against the entry
        point of this one: each call of it is relayed here, one at a time, to a fork of this interpreter
        (its namespace as the cells left it, `files` placed in its workspace first, as in `check`), and
        only its plain-value answer goes back, which the judge decodes. No code of the rollout runs where
        the verdict is made, so none can forge it. The workspace is put back afterwards.
        InterpreterStopped as `check`; JudgeFailed when the judge itself fails (an outage: the grade is
        retried)."""
        serve_id, judge_id = uuid.uuid4().hex, uuid.uuid4().hex
        ended = json.dumps({"error": "the solution's process ended (it exited, crashed or was killed)"})
        final: dict[str, Any] | None = None  # this interpreter's answer to `serve`: its fork has ended
        verdict: dict[str, Any] | None = None
        failed: JudgeFailed | None = None  # the judge's failure: the fork is still ended cleanly first
        relayed = False  # whether the judge was given an answer of the rollout's
        async with self._grading():
            try:
                await self.send_frame(
                    {
                        "id": serve_id,
                        "serve": {
                            "entry_point": job["entry_point"],
                            "prompt": job.get("prompt") or "",
                            "runner": harness_source("harness_runner.py"),
                        },
                        "seconds": seconds,
                        "files": dict(files),
                        "max_reply_chars": MAX_CALL_REPLY_CHARS,  # the driver's cap, so none is sent past it
                        "max_frame_bytes": MAX_FRAME_BYTES,  # what the driver relays from its fork
                    }
                )
                with contextlib.suppress(TimeoutError):  # the tests' time is up: not passed, timed out
                    async with asyncio.timeout(seconds):
                        await _judge_step(
                            judge.send_frame(
                                {"id": judge_id, "judge": {**job, "main": harness_source("harness_main.py")}}
                            )
                        )
                        while True:
                            frame = await _judge_step(judge._receive(MAX_FRAME_BYTES))
                            if frame.get("id") != judge_id:
                                raise JudgeFailed("the judge answered another request")
                            line = frame.get("line")
                            if not isinstance(line, str):
                                verdict = frame
                                break
                            answer_line = ended
                            if final is None:
                                await self.send_frame({"line": line})
                                reply = await self._answer_to(serve_id, MAX_FRAME_BYTES)
                                if isinstance(reply.get("line"), str):
                                    answer_line = _relayed(reply["line"])
                                    relayed = True
                                else:
                                    final = reply  # the call ended its fork (an exit): its answer came
                            await _judge_step(judge.send_frame({"line": answer_line}))
            except JudgeFailed as exc:
                failed = exc
            if final is None:
                # Its sending is bounded too: a fork that answers without reading its calls can fill the
                # frame pipe while the driver waits for the server to read it (then killed, as any timeout).
                async with asyncio.timeout(seconds + CHECK_GRACE_SECONDS):
                    await self.send_frame({"end": True})  # skipped by the driver if the fork ended meanwhile
                    while final is None or "line" in final:  # a late answer of a cut call first
                        final = await self._answer_to(serve_id, MAX_FRAME_BYTES)
            restored = final.get("restored") is True
            not_placed = _not_placed(final.get("not_placed"))
        self._restored_or_stopped(restored)
        if failed is not None:
            if not (relayed and await judge.ran_out_of_memory()):
                raise failed  # the rollout's interpreter is as it was: the grade can be retried
            # The judge died at its memory cap holding the rollout's answers: what they made it hold is
            # the rollout's doing, and a retry would end the same way. A failed grade, never a 503.
            verdict = {
                "passed": False,
                "error": "the grade's judge ran out of memory on the solution's answers",
            }
        timed_out = verdict is None or final.get("timed_out") is True
        passed = verdict is not None and verdict.get("passed") is True and not timed_out
        error = verdict.get("error") if verdict is not None else None
        return CheckVerdict(
            passed=passed,
            error=plain_text(error) if isinstance(error, str) else None,
            timed_out=timed_out,
            not_placed=not_placed,
        )

    @contextlib.asynccontextmanager
    async def _grading(self) -> AsyncIterator[None]:
        """A grade's exchange with this interpreter: InterpreterStopped when it ends, answers what no
        driver answers or runs out of time (then it is killed), as after a cell."""
        try:
            yield
        except TimeoutError as exc:
            self.broken = True
            self.session.kill()
            raise InterpreterStopped("the interpreter did not answer a grade's check in time") from exc
        except Exception as exc:
            self.broken = True
            raise InterpreterStopped(await self._why_ended()) from exc
        except BaseException:
            self.broken = True
            self.session.kill()
            raise

    def _restored_or_stopped(self, restored: bool) -> None:
        """After a grade: kept (and stopped until its next request) when its workspace was put back, else
        killed (InterpreterStopped): no later call runs against a changed box."""
        if not restored:
            self.broken = True
            self.session.kill()
            raise InterpreterStopped("a grade's check changed the interpreter's workspace beyond repair")
        self.session.freeze_later(FREEZE_AFTER_SECONDS)

    async def _answer_to(self, request_id: str, cap: int) -> dict[str, Any]:
        """The frame answering the request `request_id`. The driver answers each request once, and a call
        cut short stops its interpreter, so a frame of another id was written by a cell: ValueError (the
        interpreter is stopped), never an answer to this request, never a frame to skip and wait on."""
        answer = await self._receive(cap)
        if answer.get("id") != request_id:
            raise ValueError("a frame that answers no request")
        return answer

    async def _receive(self, cap: int) -> dict[str, Any]:
        # A frame's size is kept once read, so a read cut between it and the body (a grade's time limit)
        # leaves the next read where the frame's body begins, never reading the body as a size.
        if self._frame_size is None:
            (self._frame_size,) = struct.unpack(">I", await self.session.receive(4))
        size = self._frame_size
        if size > cap:
            raise ValueError("frame too large")
        body = await self.session.receive(size)
        self._frame_size = None
        # A large frame (files, output) is decoded in a thread: a cell can make it as slow to decode as
        # JSON gets, and the event loop serves every other rollout meanwhile.
        answer = await asyncio.to_thread(json.loads, body) if size > THREAD_DECODE_BYTES else json.loads(body)
        if not isinstance(answer, dict):
            raise ValueError("not a frame")
        return answer

    async def ran_out_of_memory(self) -> bool:
        """Whether the kernel killed a process of this interpreter at its memory cap (it is stopped)."""
        await self.session.close()
        return self.session.memory_exceeded

    async def _why_ended(self) -> str:
        code = await self.session.close(grace=ENDING_GRACE_SECONDS)
        if self.session.memory_exceeded:
            what = "it used more memory than its limit"
        elif code is not None and code >= 0:
            what = f"it exited with status {code}"
        else:
            what = "it was killed" if code is None else f"it was killed by signal {-code}"
        return f"the interpreter stopped while running this code ({what}); its state is lost"


def frame_cap(limits: InterpreterLimits) -> int:
    """The largest answer a cell can honestly have under `limits`: its two outputs and the workspace's
    files (base64), their names and the report's framing, its value and traceback."""
    raw = 2 * limits.run.output_bytes + report_cap(limits.run)
    return min(MAX_FRAME_BYTES, raw * 4 // 3 + FRAME_SLACK_BYTES)


def plain_text(text: str) -> str:
    """`text` cut to TEXT_CHARS, its lone surrogates (a `repr` or an exception can hold them; no JSON
    encoder writes them) written as their escapes."""
    text = text[:TEXT_CHARS]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _not_placed(value: Any) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(item, list) and len(item) == 2 and all(isinstance(part, str) for part in item)
        for item in value
    ):
        raise TypeError("not_placed must be a list of [path, why]")
    return tuple((path, plain_text(why)[:500]) for path, why in value[:100])


def _total(value: Any) -> int:
    if type(value) is not int or not 0 <= value <= MAX_TOTAL:
        raise TypeError("an output's size must be a count of bytes")
    return value


def _relayed(line: str) -> str:
    """An entry point's answer as the judge gets it: a failed call when it is over the cap."""
    if len(line) > MAX_CALL_REPLY_CHARS:
        return json.dumps({"error": f"the value is too large to send ({len(line)} characters)"})
    return line


async def _judge_step(step: Awaitable[T]) -> T:
    """A step of the judge's conversation: what fails there is the judge's failure (JudgeFailed)."""
    try:
        return await step
    except JudgeFailed:
        raise
    except (ConnectionError, asyncio.IncompleteReadError, ValueError, struct.error) as exc:
        raise JudgeFailed(f"the grade's judge stopped ({type(exc).__name__}: {exc})") from exc


def _decoded(text: Any) -> bytes:
    if not isinstance(text, str):
        raise TypeError("not base64 text")
    return base64.b64decode(text, validate=True)


def _cell_result(answer: Mapping[str, Any]) -> CellResult:
    """The answer's fields, checked (a malformed one is a broken interpreter: ValueError/TypeError)."""
    value, exception = answer["value"], answer["exception"]
    if not (value is None or isinstance(value, str)) or not (exception is None or isinstance(exception, str)):
        raise TypeError("value and exception must be text")
    report = parse_report(_decoded(answer["files"]))
    files = RunResult(
        exit_code=0,
        stdout=Output(b"", 0),
        stderr=Output(b"", 0),
        wall_seconds=0.0,
        files=report.files,
        skipped=report.skipped,
        unseen=report.unseen,
        files_complete=not report.truncated,
    )
    return CellResult(
        stdout=_decoded(answer["stdout"]),
        stdout_total=_total(answer["stdout_total"]),
        stderr=_decoded(answer["stderr"]),
        stderr_total=_total(answer["stderr_total"]),
        value=None if value is None else plain_text(value),
        exception=None if exception is None else plain_text(exception),
        files=files,
        not_placed=_not_placed(answer.get("not_placed")),
    )


def worker_name() -> str:
    """This worker's name in rollout state: host, process (pid and start time) and a random part."""
    identity = process_identity(os.getpid()) or str(os.getpid())
    return f"{socket.gethostname()}:{identity}:{uuid.uuid4().hex[:8]}"


class InterpreterPool:
    """The live interpreters of one worker, by rollout."""

    def __init__(
        self, sandbox: Sandbox, limits: InterpreterLimits, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.sandbox = sandbox
        self.limits = limits
        self.clock = clock
        self.worker = worker_name()
        self.live: OrderedDict[str, Interpreter] = OrderedDict()  # least recently used first
        self.lost: OrderedDict[str, Lost] = OrderedDict()  # why a rollout's interpreter was stopped
        # Started and ready, never any rollout's yet (no cell ever ran in them): `limits.spares` of them.
        self.spares: deque[Interpreter] = deque()
        self._opening = asyncio.Lock()
        self._reaper: asyncio.Task[None] | None = None
        self._refilling: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Future[int | None]] = set()  # judges being stopped
        self._closed = False

    @contextlib.asynccontextmanager
    async def use(
        self, trace_id: str, marker: Mapping[str, Any] | None
    ) -> AsyncIterator[tuple[Interpreter, str | None]]:
        """The rollout's interpreter, held (nothing stops it meanwhile), and why the earlier one is lost
        when a new one had to start (None when nothing was lost)."""
        while True:
            current = self.live.get(trace_id)
            if current is not None and (
                current.session.closed or current.session.process.returncode is not None
            ):
                # Ended, or being stopped (a call cut short while its interpreter was being stopped leaves
                # it so): waited for here, never looked at again and again.
                await self.discard(trace_id, self._why(trace_id, "it ended between calls"))
                current = None
            if current is None or not current.matches(marker):
                break
            await current.lock.acquire()
            if self._still(trace_id, current, marker):
                current.stored = current.stored or current.cells > 0
                try:
                    self.live.move_to_end(trace_id)
                    yield current, None
                    current.last_used = self.clock()
                finally:
                    current.lock.release()
                return
            # Stopped, replaced or put out of step while this call waited for it (a grade held it):
            # looked at again.
            current.lock.release()
        reason = None
        if current is not None:
            # Its rollout does not know the cells it ran (their answers were not stored), or names another.
            await self.discard(trace_id, "a call's code ran in it but its answer was not stored")
            if marker is None and current.stored:
                # The rollout's state is gone (it expired, or was removed) while its interpreter lived:
                # what its cells defined is lost, and the model is told so.
                reason = "the rollout's state was lost (it expired or was removed), and its variables with it"
        if marker is not None:
            lost = self.lost.pop(trace_id, None)
            reason = lost.reason if lost is not None else "it was stopped"
            if marker.get("worker") != self.worker:
                reason = (
                    "it lived in another server process, or this one restarted; the calls of one trace_id "
                    "must reach one worker (docs/deploy.md)"
                )
        interpreter = await self._open(trace_id)
        try:
            yield interpreter, reason
            interpreter.last_used = self.clock()
        finally:
            interpreter.lock.release()

    @contextlib.asynccontextmanager
    async def held(self, trace_id: str, marker: Mapping[str, Any] | None) -> AsyncIterator[Interpreter]:
        """The rollout's own live interpreter, held, for a grade: never a new one. InterpreterGone says
        plainly why there is none (never started, stopped, in another worker, or not in the state the
        rollout recorded)."""
        if marker is None:
            raise InterpreterGone("the rollout never ran code in an interpreter (no `python` call)")
        current = self.live.get(trace_id)
        if current is None or current.session.process.returncode is not None:
            if marker.get("worker") != self.worker:
                raise InterpreterGone(
                    "its interpreter lived in another server process, or this one restarted; a grade "
                    "in the interpreter must reach the worker of the rollout's calls (docs/deploy.md)"
                )
            lost = self.lost.get(trace_id)
            reason = lost.reason if lost is not None else "it was stopped"
            if lost is not None and lost.session is not None and marker.get("session") == lost.session:
                raise StoppedByItsCode(f"the rollout's interpreter is gone: {reason}")
            raise InterpreterGone(f"its interpreter is gone ({reason})")
        async with current.lock:
            if self.live.get(trace_id) is not current or current.session.closed:
                raise InterpreterGone(f"its interpreter is gone ({self._why(trace_id, 'it was stopped')})")
            if not current.matches(marker):
                raise InterpreterGone(
                    "its interpreter is not in the state the rollout recorded (a call's code ran in it but "
                    "its answer was not stored)"
                    if marker.get("session") == current.id
                    else "its interpreter is not the one the rollout recorded"
                )
            self.live.move_to_end(trace_id)
            yield current
            current.last_used = self.clock()

    def _why(self, trace_id: str, otherwise: str) -> str:
        lost = self.lost.get(trace_id)
        return lost.reason if lost is not None else otherwise

    def _still(self, trace_id: str, interpreter: Interpreter, marker: Mapping[str, Any] | None) -> bool:
        """Whether `interpreter`, just acquired, is still the rollout's, running and in the rollout's step."""
        return (
            self.live.get(trace_id) is interpreter
            and not interpreter.session.closed
            and interpreter.session.process.returncode is None
            and interpreter.matches(marker)
        )

    async def _open(self, trace_id: str) -> Interpreter:
        """A new interpreter for the rollout, started and ready, returned with its lock held: a spare when
        one is ready (never used by anyone: no cell ran in it), else one started now."""
        async with self._opening:
            while len(self.live) >= self.limits.max_live:
                victim = next((t for t, i in self.live.items() if not i.lock.locked()), None)
                if victim is None:
                    raise InterpreterBusy(f"all {self.limits.max_live} interpreters of this worker are busy")
                await self.discard(
                    victim,
                    f"it was the least recently used when this worker reached its {self.limits.max_live} "
                    "interpreters",
                )
            interpreter = await self._take_spare()
            self._refill()
            if interpreter is not None:
                await interpreter.lock.acquire()
                self.live[trace_id] = interpreter
                return interpreter
            session = await self._start_session()
            interpreter = Interpreter(session, self.worker, self.clock())
            await interpreter.lock.acquire()
            self.live[trace_id] = interpreter
        try:
            await self._ready(interpreter)
        except BaseException:  # it never came, or the call was cancelled meanwhile: nothing is left held
            if self.live.get(trace_id) is interpreter:
                del self.live[trace_id]
            interpreter.lock.release()
            interpreter.session.kill()
            await interpreter.session.close()  # shielded: done even when this call is cancelled
            raise
        return interpreter

    @contextlib.asynccontextmanager
    async def judge(self) -> AsyncIterator[Interpreter]:
        """An interpreter no cell ever ran in, for a grade's hidden tests (`Interpreter.judged`): a spare
        when one is ready, else one started now; stopped afterwards, never anyone's."""
        judge = await self._take_spare()
        self._refill()
        try:
            if judge is None:
                try:
                    judge = Interpreter(await self._start_session(), self.worker, self.clock())
                except (OSError, SandboxUnavailable) as exc:
                    raise JudgeFailed(f"the grade's judge could not start: {exc}") from exc
                try:
                    await self._ready(judge)
                except OSError as exc:
                    raise JudgeFailed(f"the grade's judge {exc}") from exc
            yield judge
        finally:
            if judge is not None:
                # Stopped behind the grade's answer (the pool's close waits for it); once the pool is
                # closing, here (its close may have waited for the others already).
                closing = asyncio.ensure_future(judge.session.close())
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
                if self._closed:
                    await asyncio.shield(closing)

    async def _start_session(self) -> Session:
        return await self.sandbox.open_session(
            harness_source("harness_interpreter.py"),
            [harness_source("harness_supervisor.py")],
            limits=replace(self.limits.run, cpu_seconds=self.limits.cpu_seconds),
        )

    async def _ready(self, interpreter: Interpreter) -> None:
        """Wait for a new interpreter's driver; OSError (and the interpreter stopped) if it never came."""
        try:
            await interpreter.ready()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            await interpreter.session.close()
            stderr = (await interpreter.session.stderr()).decode("utf-8", "replace").strip()[:500]
            raise OSError(f"the interpreter did not start ({stderr or type(exc).__name__})") from exc

    async def _take_spare(self) -> Interpreter | None:
        """A spare still running (one that ended while it waited is stopped and passed over)."""
        while self.spares:
            interpreter = self.spares.popleft()
            if interpreter.session.process.returncode is None and not interpreter.broken:
                interpreter.last_used = self.clock()
                return interpreter
            await interpreter.session.close()
        return None

    def _refill(self) -> None:
        """Start the spares missing, in the background (one at a time, after the call that took one)."""
        if self._closed or len(self.spares) >= self.limits.spares:
            return
        if self._refilling is None or self._refilling.done():
            self._refilling = asyncio.ensure_future(self._refill_spares())

    async def _refill_spares(self) -> None:
        while not self._closed and len(self.spares) < self.limits.spares:
            try:
                interpreter = Interpreter(await self._start_session(), self.worker, self.clock())
            except (OSError, SandboxUnavailable) as exc:
                log.warning("code interpreter: a spare interpreter could not start: %s", exc)
                return  # the next rollout's first call starts its own (and says why if it cannot)
            try:
                if not self._closed:
                    await self._ready(interpreter)
            except OSError as exc:
                log.warning("code interpreter: a spare %s", exc)
                return
            finally:
                if self._closed:  # the pool closed meanwhile (close waits for this task)
                    await interpreter.session.close()
            if self._closed:
                return
            self.spares.append(interpreter)

    async def discard(
        self, trace_id: str, reason: str, only: Interpreter | None = None, *, by_its_code: bool = False
    ) -> None:
        """Stop the rollout's interpreter (if live here), remembering why for its next call (and for a
        grade, whether the rollout's own code stopped it: `by_its_code`); with `only`, that interpreter, and
        the rollout's only while it is that one (another call may have replaced it)."""
        if only is not None and self.live.get(trace_id) is not only:
            await only.session.close()
            return
        interpreter = self.live.pop(trace_id, None)
        if reason:
            session = interpreter.id if by_its_code and interpreter is not None else None
            self.lost.pop(trace_id, None)  # the newest reasons are kept longest
            self.lost[trace_id] = Lost(reason, session)
            while len(self.lost) > LOST_REASONS_KEPT:
                self.lost.popitem(last=False)
        elif interpreter is not None:
            self.lost.pop(trace_id, None)  # an older reason is not this interpreter's
        if interpreter is not None:
            await interpreter.session.close()

    async def reap(self) -> None:
        """Stop the interpreters idle for longer than the limit."""
        now = self.clock()
        idle = [
            trace_id
            for trace_id, interpreter in self.live.items()
            if not interpreter.lock.locked() and now - interpreter.last_used > self.limits.idle_seconds
        ]
        for trace_id in idle:
            # Looked at again: a call may have taken it while an earlier one of these was being stopped.
            interpreter = self.live.get(trace_id)
            if interpreter is None or interpreter.lock.locked():
                continue
            if self.clock() - interpreter.last_used <= self.limits.idle_seconds:
                continue
            await self.discard(trace_id, f"it was idle for more than {self.limits.idle_seconds:g} seconds")

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(self.limits.idle_seconds / 4, 10.0)))
            try:
                await self.reap()
            except Exception:  # a failure to stop one must not end the reaper
                log.exception("code interpreter: stopping idle interpreters failed")

    def start(self) -> None:
        self._reaper = asyncio.ensure_future(self._reap_forever())
        self._refill()

    async def close(self) -> None:
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self._refilling is not None:
            # Not cancelled: it stops at its next step and stops what it started (`_closed`).
            with contextlib.suppress(Exception):
                await self._refilling
        for trace_id in list(self.live):
            await self.discard(trace_id, "")
        while self.spares:
            await self.spares.popleft().session.close()
        while self._closing:  # a grade ending meanwhile adds its judge
            await asyncio.gather(*self._closing, return_exceptions=True)
