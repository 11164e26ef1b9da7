"""A pool of worker subprocesses that run python graders with a time and a memory limit.

Each worker (app/grading/graders/python_worker.py) runs one grade at a time with an address-space limit set by
`resource.setrlimit`; a grade that exceeds the per-call timeout gets its worker killed (with anything
it started) and replaced on the next call. Workers start on first use, in a private temporary
directory, with an environment that holds none of the server's settings or secrets.

This is isolation for robustness, not a security sandbox: the grader source comes from the operator's
own config, and the model's output only ever reaches it as data.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from app.grading.graders.model import GraderUnavailable

WORKER = Path(__file__).with_name("python_worker.py")
START_TIMEOUT = 30.0
READ_LIMIT = 1024 * 1024


@dataclass(frozen=True)
class PythonPoolSettings:
    workers: int = 2
    timeout: float = 10.0  # seconds per grade
    memory_mb: int = 512  # address space of each worker


@dataclass(frozen=True)
class PythonOutcome:
    score: float | None
    error: str | None


class WorkerFailed(Exception):
    pass


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def request(self, payload: bytes) -> dict[str, Any]:
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(payload)
            await stdin.drain()
            line = await stdout.readline()
        except (ConnectionError, ValueError, asyncio.LimitOverrunError) as exc:
            raise WorkerFailed(f"lost the grader process: {type(exc).__name__}") from exc
        if not line:
            code = await self.process.wait()
            raise WorkerFailed(f"the grader process died ({_exit_reason(code)})")
        try:
            answer = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise WorkerFailed("the grader process answered something that is not JSON") from exc
        if not isinstance(answer, dict):
            raise WorkerFailed("the grader process answered something that is not an object")
        return answer

    async def kill(self) -> None:
        if self.alive:
            # The worker leads its own session: kill the group, so a subprocess it started dies too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class PythonPool:
    """Runs grader sources on up to `workers` processes at once."""

    def __init__(self, settings: PythonPoolSettings) -> None:
        self.settings = settings
        self._slots = asyncio.Semaphore(settings.workers)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._directory: str | None = None
        self._closed = False
        self.spawned = 0

    async def run(
        self, source: str, sample: Any, item: Any, rollout: Any | None = None, *, with_rollout: bool = False
    ) -> PythonOutcome:
        """Grade once: a grader's failure is an outcome with an error; a broken pool is GraderUnavailable."""
        request: dict[str, Any] = {"source": source, "sample": sample, "item": item}
        if with_rollout:
            request["rollout"] = rollout
        try:
            payload = orjson.dumps(request, default=str, option=orjson.OPT_NON_STR_KEYS) + b"\n"
        except TypeError as exc:
            return PythonOutcome(None, f"cannot pass the sample to the grader: {exc}")
        async with self._slots:
            worker = await self._take()
            try:
                answer = await asyncio.wait_for(worker.request(payload), self.settings.timeout)
            except TimeoutError:
                await self._discard(worker)
                return PythonOutcome(
                    None, f"the grader ran longer than {self.settings.timeout:g}s and was killed"
                )
            except WorkerFailed as exc:
                await self._discard(worker)
                return PythonOutcome(None, str(exc))
            except BaseException:
                await self._discard(worker)  # cancelled mid-grade: its answer would confuse the next one
                raise
            self._idle.append(worker)
        if "error" in answer:
            return PythonOutcome(None, str(answer["error"]))
        score = answer.get("score")
        if not isinstance(score, int | float) or isinstance(score, bool):
            return PythonOutcome(None, f"the grader process answered {answer!r}")
        return PythonOutcome(float(score), None)

    async def start(self) -> None:
        """Start every worker now instead of on first use (a warm-up, before grades arrive)."""
        while len(self._all) < self.settings.workers:
            self._idle.append(await self._spawn())

    async def _take(self) -> _Worker:
        while self._idle:
            worker = self._idle.pop()
            if worker.alive:
                return worker
            await self._discard(worker)
        return await self._spawn()

    async def _discard(self, worker: _Worker) -> None:
        self._all.discard(worker)
        await worker.kill()

    def _workdir(self) -> str:
        if self._directory is None:
            self._directory = tempfile.mkdtemp(prefix="sparring-graders-")
        return self._directory

    async def _spawn(self) -> _Worker:
        if self._closed:
            raise GraderUnavailable("the python grader pool is closed")
        environment = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            # Numeric libraries must not start a thread per core in every worker.
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                str(WORKER),
                str(self.settings.memory_mb),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                cwd=self._workdir(),
                env=environment,
                start_new_session=True,
                limit=READ_LIMIT,
            )
        except OSError as exc:
            raise GraderUnavailable(f"cannot start a python grader process: {exc}") from exc
        worker = _Worker(process)
        self._all.add(worker)
        reason = await self._handshake(process)
        if reason is not None:
            await self._discard(worker)
            raise GraderUnavailable(f"a python grader process failed to start ({reason})")
        self.spawned += 1
        return worker

    @staticmethod
    async def _handshake(process: asyncio.subprocess.Process) -> str | None:
        """None once the worker says it is ready; else why it is not."""
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT)
        except TimeoutError:
            return f"no answer in {START_TIMEOUT:g}s"
        except (ValueError, asyncio.LimitOverrunError):
            return "an unreadable first line"
        if not line:
            # It closed its output: let it finish exiting, so its own exit code is what we report.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), 5)
            code = process.returncode
            return _exit_reason(code) if code is not None else "it closed its output"
        try:
            ready = orjson.loads(line)
        except orjson.JSONDecodeError:
            return f"it printed {line[:80]!r}"
        return None if isinstance(ready, dict) and ready.get("ready") else f"it answered {line[:80]!r}"

    async def aclose(self) -> None:
        self._closed = True
        workers, self._idle = list(self._all), []
        self._all.clear()
        for worker in workers:
            await worker.kill()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
