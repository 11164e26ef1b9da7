"""openenv's real clients, in a virtualenv of their own, driven through tests/episodes/openenv_driver.py.

The pin is pyproject's `openenv-client` extra. The venv (.venv-openenv beside .venv) is built once per
machine and rebuilt when the pin changes; a stamp file holds the pin it was built with.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-openenv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".pinned"
DRIVER = Path(__file__).with_name("openenv_driver.py")


def client_pins() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins: list[str] = project["optional-dependencies"]["openenv-client"]
    return pins


def ensure_venv() -> Path:
    """The client venv's Python, built (python -m venv, pip install the pins) if missing or stale."""
    pins = client_pins()
    wanted = "\n".join(pins)
    if PYTHON.exists() and STAMP.exists() and STAMP.read_text() == wanted:
        return PYTHON
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(VENV)], check=True)
    subprocess.run([str(PYTHON), "-m", "ensurepip", "--upgrade"], check=True, capture_output=True)
    subprocess.run([str(PYTHON), "-m", "pip", "install", "--quiet", *pins], check=True, timeout=900)
    STAMP.write_text(wanted)
    return PYTHON


async def drive(python: Path, scenario: str, url: str, headers: dict[str, str], **args: Any) -> Any:
    """Run one driver scenario against `url` (the mount) and return its JSON answer."""
    command = orjson.dumps({"scenario": scenario, "url": url, "headers": headers, "args": args})

    def run() -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([str(python), str(DRIVER)], input=command, capture_output=True, timeout=180)

    done = await asyncio.to_thread(run)
    if done.returncode != 0:
        raise AssertionError(f"openenv driver {scenario} failed:\n{done.stderr.decode(errors='replace')}")
    return orjson.loads(done.stdout)
