"""The code pack's settings (SPARRING_CODE_*) and lifespan: its data located and its sandbox, per app."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
from pydantic import Field

from app.sdk import Base, DataLocation, PackSettings, PackStart, pack_settings_config
from tools.code import data
from tools.code.interpreter import InterpreterLimits, InterpreterPool
from tools.code.sandbox import Containment, Limits, Sandbox, SandboxUnavailable, create, probe
from tools.code.tasks import CodeTask, load_tasks
from tools.code.warm import WarmRunner
from tools.code.workspace import LIMITS
from tools.code.workspace import load_base as workspace_base

log = logging.getLogger("sparring.packs.code")

# Each run: 10 s of wall clock and CPU, 32 processes, 64 open files, files of at most 1 MiB, 16 KiB of
# each output stream kept; its memory, workspace size and slots are the settings' (`Containment`).
RUN_LIMITS = Limits(
    wall_seconds=10.0,
    cpu_seconds=10,
    max_files=LIMITS.max_files,
    max_workspace_bytes=LIMITS.max_workspace_bytes,
)

UNSAFE_WARNING = (
    "SPARRING_CODE_SANDBOX=unsafe-local: the code pack runs model-written code WITHOUT ISOLATION, as the "
    "server's own user, with its network and files. Use it only for local development, never for training"
)


class CodeSettings(PackSettings):
    """The code pack's settings: `SPARRING_CODE_*`."""

    model_config = pack_settings_config("code")

    data: Path | None = Field(
        None, description="Directory holding HumanEval.jsonl.gz for the code pack (skips the download)."
    )
    sandbox: Literal["bwrap", "unsafe-local"] = Field(
        "bwrap",
        description="How the code pack runs code: bwrap, or unsafe-local (no isolation, loopback only).",
    )
    python: Path | None = Field(
        None,
        description="Interpreter the code pack's sandbox runs (default: the server's, else python3).",
    )
    run_memory_bytes: int = Field(
        1024 * 1024 * 1024,
        ge=64 * 1024 * 1024,
        description="Memory of one code run, all its processes together (a cgroup; per process without).",
    )
    workspace_bytes: int = Field(
        64 * 1024 * 1024,
        ge=4 * 1024 * 1024,
        description="Size of a code run's /workspace (a tmpfs in the sandbox's memory, never on disk).",
    )
    shm_bytes: int = Field(
        16 * 1024 * 1024, ge=1024 * 1024, description="Size of a code run's /dev/shm (a tmpfs)."
    )
    sandbox_slots: int = Field(
        0, ge=0, description="Code runs one worker runs at once (0: twice the CPU count, at least 2)."
    )
    sandbox_slots_per_rollout: int = Field(
        2, ge=1, description="Code runs one rollout holds at once, so a busy rollout cannot starve others."
    )

    warm: bool = Field(
        True,
        description="Runs fork from a warm sandbox parent per worker where it works (false: every run cold).",
    )
    warm_runs: int = Field(
        500,
        ge=1,
        description="Runs one warm sandbox parent serves before it is replaced by a fresh one.",
    )

    interpreter_idle_seconds: float = Field(
        600.0, gt=0, description="A rollout's `python` interpreter is stopped after this long without a call."
    )
    interpreter_max: int = Field(
        16,
        ge=1,
        description="Live `python` interpreters per worker; at the cap the least recently used stops.",
    )
    interpreter_cell_seconds: float = Field(
        30.0,
        gt=0,
        description="Wall clock of one `python` call; a longer one stops (and loses) the interpreter.",
    )
    interpreter_cpu_seconds: int = Field(
        600, ge=1, description="CPU seconds one `python` interpreter may use over its whole life."
    )
    interpreter_spares: int = Field(
        2,
        ge=0,
        description=(
            "`python` interpreters each worker keeps started ahead of any rollout: a rollout's first call "
            "takes one instead of starting its own (0: each first call starts one)."
        ),
    )

    def interpreter_limits(self) -> InterpreterLimits:
        return InterpreterLimits(
            idle_seconds=self.interpreter_idle_seconds,
            max_live=self.interpreter_max,
            cell_seconds=self.interpreter_cell_seconds,
            cpu_seconds=self.interpreter_cpu_seconds,
            run=RUN_LIMITS,
            spares=self.interpreter_spares,
        )

    def containment(self) -> Containment:
        """The limits every run of the sandbox gets, from these settings."""
        return Containment(
            memory_bytes=self.run_memory_bytes,
            workspace_bytes=self.workspace_bytes,
            shm_bytes=self.shm_bytes,
            slots=self.sandbox_slots,
            slots_per_rollout=self.sandbox_slots_per_rollout,
        )


@dataclass(frozen=True)
class CodeResources:
    """What the code pack holds while an app serves it: its tasks, and the one sandbox its runs and
    grades share."""

    sandbox: Sandbox
    tasks: Mapping[str, CodeTask]
    interpreters: InterpreterPool | None = None  # the `python` tool's, one per rollout
    warm: WarmRunner | None = None  # the warm parent (None: the cold path was asked for)

    def health(self) -> dict[str, Any]:
        """What /healthz says of the code pack: which path its runs take (warm forks or cold starts), and
        its `python` interpreters (live ones, spares started ahead, how they are stopped between calls)."""
        if self.warm is None:
            runs = {"path": "cold", "why_cold": "SPARRING_CODE_WARM=false"}
        elif not self.sandbox.isolated:
            runs = {"path": "cold", "why_cold": "the unsafe-local sandbox"}
        else:
            runs = self.warm.describe()
        health: dict[str, Any] = {"sandbox": self.sandbox.mode, **runs}
        if self.interpreters is not None:
            health["interpreters"] = {
                "live": len(self.interpreters.live),
                "spares": len(self.interpreters.spares),
                "stopped_between_calls": self.sandbox.freezer.mechanism,  # how (freezer.py)
            }
        return health


def build_sandbox(settings: CodeSettings, *, home: Path, binds_loopback: bool) -> Sandbox:
    """The sandbox the settings ask for; SandboxUnavailable says what to install or allow."""
    if settings.sandbox == "unsafe-local":
        if not binds_loopback:
            raise SandboxUnavailable(
                "SPARRING_CODE_SANDBOX=unsafe-local runs code without isolation and is refused on a "
                "non-loopback address; install bubblewrap and use the default bwrap sandbox"
            )
        log.warning(UNSAFE_WARNING)
    return create(settings.sandbox, python=settings.python, home=home, containment=settings.containment())


def read_tasks(settings: CodeSettings, home: Path) -> Mapping[str, CodeTask]:
    """The tasks of SPARRING_CODE_DATA, or of the cache under SPARRING_HOME (fetched there if empty)."""
    return load_tasks(data.DATA.resolve(DataLocation(settings.data, home)))


def load_base(resources: CodeResources) -> Base:
    return workspace_base(resources.tasks)


@asynccontextmanager
async def lifespan(start: PackStart[CodeSettings]) -> AsyncIterator[CodeResources]:
    """Find (or fetch) HumanEval, then build and try the sandbox; refuse to start if it cannot run code.

    The sandbox lives as long as the app: its directory is removed when the app stops, and the rollouts'
    interpreters (the `python` tool's) are stopped.
    """
    tasks = await anyio.to_thread.run_sync(read_tasks, start.settings, start.home)
    sandbox = build_sandbox(start.settings, home=start.home, binds_loopback=start.binds_loopback)
    interpreters = InterpreterPool(sandbox, start.settings.interpreter_limits())
    warm = WarmRunner(sandbox, start.settings.warm_runs) if start.settings.warm else None
    try:
        await probe(sandbox)
        if warm is not None and sandbox.isolated and await warm.start():
            sandbox.warm = warm
        interpreters.start()
        yield CodeResources(sandbox=sandbox, tasks=tasks, interpreters=interpreters, warm=warm)
    finally:
        await interpreters.close()
        sandbox.warm = None
        if warm is not None:
            await warm.close()
        sandbox.close()
