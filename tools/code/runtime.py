"""The code pack's settings (SPARRING_CODE_*) and lifespan: its data located and its sandbox, per app."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
from pydantic import Field

from app.sdk import Base, DataLocation, PackSettings, PackStart, pack_settings_config
from tools.code import data
from tools.code.sandbox import Containment, Sandbox, SandboxUnavailable, create, probe
from tools.code.tasks import CodeTask, load_tasks
from tools.code.workspace import load_base as workspace_base

log = logging.getLogger("sparring.packs.code")

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

    The sandbox lives as long as the app: its directory is removed when the app stops.
    """
    tasks = await anyio.to_thread.run_sync(read_tasks, start.settings, start.home)
    sandbox = build_sandbox(start.settings, home=start.home, binds_loopback=start.binds_loopback)
    try:
        await probe(sandbox)
        yield CodeResources(sandbox=sandbox, tasks=tasks)
    finally:
        sandbox.close()
