"""openenv's real clients, in a virtualenv of their own, driven through tests/episodes/openenv_driver.py.

The pin is pyproject's `openenv-client` extra; the venv is .venv-openenv (tests/episodes/client_venv.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.episodes.client_venv import ROOT, ClientVenv

CLIENT = ClientVenv("openenv-client", ROOT / ".venv-openenv", Path(__file__).with_name("openenv_driver.py"))


def ensure_venv() -> Path:
    return CLIENT.ensure()


async def drive(python: Path, scenario: str, url: str, headers: dict[str, str], **args: Any) -> Any:
    return await CLIENT.drive(python, scenario, url, headers, **args)
