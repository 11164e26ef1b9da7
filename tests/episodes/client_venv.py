"""An official client in a virtualenv of its own, driven through a script run with that venv's Python.

Some official clients cannot share sparring's venv (their pins exclude the server's). Each one's pin is
a pyproject extra; its venv (`.venv-<name>` beside .venv) is built once per machine and rebuilt when the
pin changes, a stamp file holding the pin it was built with. Its driver script reads one JSON command on
stdin and prints one JSON answer on stdout.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ClientVenv:
    extra: str  # the pyproject extra holding the pins
    venv: Path
    driver: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def pins(self) -> list[str]:
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        pins: list[str] = project["optional-dependencies"][self.extra]
        return pins

    def ensure(self) -> Path:
        """The venv's Python, built (python -m venv, pip install the pins) if missing or stale."""
        stamp, wanted = self.venv / ".pinned", "\n".join(self.pins())
        if self.python.exists() and stamp.exists() and stamp.read_text() == wanted:
            return self.python
        subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(self.venv)], check=True)
        subprocess.run([str(self.python), "-m", "ensurepip", "--upgrade"], check=True, capture_output=True)
        install = [str(self.python), "-m", "pip", "install", "--quiet", *self.pins()]
        subprocess.run(install, check=True, timeout=900)
        stamp.write_text(wanted)
        return self.python

    async def drive(self, python: Path, scenario: str, url: str, headers: dict[str, str], **args: Any) -> Any:
        """Run one driver scenario against `url` and return its JSON answer."""
        command = orjson.dumps({"scenario": scenario, "url": url, "headers": headers, "args": args})

        def run() -> subprocess.CompletedProcess[bytes]:
            return subprocess.run(
                [str(python), str(self.driver)], input=command, capture_output=True, timeout=180
            )

        done = await asyncio.to_thread(run)
        if done.returncode != 0:
            stderr = done.stderr.decode(errors="replace")
            raise AssertionError(f"{self.extra} driver {scenario} failed:\n{stderr}")
        return orjson.loads(done.stdout)
