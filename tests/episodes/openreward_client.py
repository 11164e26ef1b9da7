"""openreward's real client, in a virtualenv of its own, driven through tests/episodes/openreward_driver.py.

The pin is pyproject's `openreward-client` extra; the venv is .venv-openreward
(tests/episodes/client_venv.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.episodes.client_venv import ROOT, ClientVenv

CLIENT = ClientVenv(
    "openreward-client", ROOT / ".venv-openreward", Path(__file__).with_name("openreward_driver.py")
)


def ensure_venv() -> Path:
    return CLIENT.ensure()


async def drive(python: Path, scenario: str, url: str, headers: dict[str, str], **args: Any) -> Any:
    return await CLIENT.drive(python, scenario, url, headers, **args)
