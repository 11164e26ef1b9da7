"""Running a dataset: rollouts of every line with bounded concurrency, a journal for `--resume`, progress.

`run_jobs` drives `run_rollout` over a list of `Job`s (one per line and sample index, each with its
policy) with at most `concurrency` rollouts in flight, writing each finished rollout to the run's
journal (`Journal`, JSONL) as soon as it ends, so an interrupted run resumes where it stopped: a
rollout that was graded is not run again; a discarded or unfinished one is.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from sparring.conversation import TranscriptStore
from sparring.loop import (
    DatasetLine,
    EpisodeLimits,
    GradeCaller,
    Policy,
    RolloutResult,
    ToolCaller,
    routes_json,
    run_rollout,
)
from sparring.tracing import RolloutTracing
from sparring.usersim import SimulatedUser
from sparring.wire import item_key


def line_key(item: Mapping[str, Any]) -> str:
    """The key of a dataset line: the server's own (`sparring.wire.item_key`: its id field, else a hash
    of the item), so the report's per-item figures and the review pages name items alike."""
    return item_key(item) or "empty"


class DatasetError(ValueError):
    pass


def read_dataset(path: Path) -> list[DatasetLine]:
    """Every non-blank line of an RFT dataset JSONL; a bad line is an error naming its number.

    A line is read as the routes read its calls' and grades' JSON (`routes_json`): a line they would
    refuse is refused here, before a model turn is spent on it.
    """
    lines: list[DatasetLine] = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not UTF-8 ({exc})") from None
            if not text.strip():
                continue
            try:
                obj = routes_json(text)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
                lines.append(DatasetLine.from_json(obj))
            except ValueError as exc:
                raise DatasetError(f"{path}:{number}: {exc}") from exc
    if not lines:
        raise DatasetError(f"{path} has no lines")
    return lines


@dataclass(frozen=True)
class Job:
    """One rollout to run: a dataset line, its key, the sample index, and the policy's name."""

    line: DatasetLine
    key: str
    sample: int
    policy: str = "model"


@dataclass
class FinishedRollout:
    """What the report needs of one finished rollout; one journal line."""

    item_key: str
    sample: int
    policy: str
    trace_id: str
    score: float | None
    discarded: str | None
    ended_by: str
    calls: int
    tool_errors: int
    input_tokens: int
    output_tokens: int
    duration_s: float

    @classmethod
    def of(cls, job: Job, result: RolloutResult) -> FinishedRollout:
        return cls(
            item_key=job.key,
            sample=job.sample,
            policy=job.policy,
            trace_id=result.trace_id,
            score=result.score if result.discarded is None else None,
            discarded=result.discarded,
            ended_by=result.ended_by,
            calls=len(result.tool_results),
            tool_errors=result.tool_errors,
            input_tokens=result.usage.input_tokens,
            output_tokens=result.usage.output_tokens,
            duration_s=round(result.duration_s, 4),
        )

    @property
    def graded(self) -> bool:
        return self.discarded is None and self.score is not None


def plan_jobs(
    lines: Sequence[DatasetLine],
    samples: int,
    policy: str = "model",
    *,
    keep: Callable[[DatasetLine], bool] | None = None,
) -> list[Job]:
    """Every (line, sample index) pair, samples of one line next to each other."""
    return [
        Job(line=line, key=line_key(line.item), sample=index, policy=policy)
        for line in lines
        if keep is None or keep(line)
        for index in range(samples)
    ]


def journal_path(home: Path, run: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", run).strip("._") or "run"
    return home / "runs" / f"{safe}.jsonl"


class Journal:
    """The finished rollouts of a run, one JSON line each, appended as they end."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> list[FinishedRollout]:
        if not self.path.exists():
            return []
        records = []
        # Split on "\n" alone: JSON leaves U+2028, U+2029 and U+0085 inside a line, `splitlines` breaks there.
        for text in self.path.read_text(encoding="utf-8").split("\n"):
            if text.strip():
                try:
                    records.append(FinishedRollout(**json.loads(text)))
                except (ValueError, TypeError):
                    continue  # a line cut by a crash mid-write: that rollout runs again
        return records

    def append(self, record: FinishedRollout) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(asdict(record), ensure_ascii=False) + "\n").encode()
        with self.path.open("a+b") as handle:
            if handle.seek(0, os.SEEK_END) > 0:
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":  # a line cut by a crash: this record starts a line of its own
                    line = b"\n" + line
            handle.write(line)


def graded_keys(records: Iterable[FinishedRollout]) -> set[tuple[str, str, int]]:
    return {(r.policy, r.item_key, r.sample) for r in records if r.graded}


def latest_per_rollout(records: Iterable[FinishedRollout]) -> list[FinishedRollout]:
    """One record per (policy, item, sample): the graded one if any, else the last attempt."""
    chosen: dict[tuple[str, str, int], FinishedRollout] = {}
    for record in records:
        key = (record.policy, record.item_key, record.sample)
        held = chosen.get(key)
        if held is None or not held.graded:
            chosen[key] = record
    return list(chosen.values())


class Progress:
    """Rollouts done / discarded / mean reward so far, redrawn on one stderr line; silent off a TTY."""

    def __init__(self, total: int, stream: TextIO | None = None, label: str = "") -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self.label = label
        self.done = 0
        self.discarded = 0
        self.score_sum = 0.0
        self.scored = 0
        self._last_draw = 0.0

    def add(self, record: FinishedRollout) -> None:
        self.done += 1
        if record.discarded is not None:
            self.discarded += 1
        elif record.score is not None:
            self.scored += 1
            self.score_sum += record.score
        self.draw()

    def draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1 and self.done < self.total:
            return
        self._last_draw = now
        width = 30
        filled = int(width * self.done / self.total) if self.total else width
        mean = f"{self.score_sum / self.scored:.3f}" if self.scored else "-"
        self.stream.write(
            f"\r{self.label}[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
            f"  discarded {self.discarded}  mean reward {mean} "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.draw(force=True)
            self.stream.write("\n")
            self.stream.flush()


async def run_jobs(
    jobs: Sequence[Job],
    policy_for: Callable[[Job], Policy],
    tools: ToolCaller,
    grader: GradeCaller | None,
    *,
    limits: EpisodeLimits,
    concurrency: int,
    on_record: Callable[[FinishedRollout], None],
    stop: asyncio.Event | None = None,
    limits_for: Callable[[Job], EpisodeLimits] | None = None,
    tracing: RolloutTracing | None = None,
    user: SimulatedUser | None = None,
    transcripts: TranscriptStore | None = None,
) -> bool:
    """Run `jobs` with at most `concurrency` rollouts in flight; False when `stop` interrupted them.

    With `user`, lines that carry a user scenario are played against the simulated user.

    Each finished rollout goes to `on_record` as it ends (its conversation first to `transcripts`).
    When `stop` is set, rollouts in flight are
    cancelled (they were not graded: a resumed run runs them again) and no new one starts.
    """
    stop = stop or asyncio.Event()
    queue = iter(jobs)

    async def worker() -> None:
        for job in queue:
            if stop.is_set():
                return
            result = await run_rollout(
                policy_for(job),
                tools,
                job.line,
                grader=grader,
                limits=limits_for(job) if limits_for is not None else limits,
                tracing=tracing,
                user=user,
            )
            if transcripts is not None:
                await transcripts.store(result)
            on_record(FinishedRollout.of(job, result))

    workers = [asyncio.create_task(worker()) for _ in range(max(1, min(concurrency, len(jobs))))]
    stopper = asyncio.create_task(stop.wait())
    try:
        pending: set[asyncio.Task[Any]] = set(workers)
        while pending:
            done, pending = await asyncio.wait(pending | {stopper}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(stopper)
            for task in done:
                if task is not stopper and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if stopper in done:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return False
        return True
    finally:
        stopper.cancel()
        for task in workers:
            task.cancel()
