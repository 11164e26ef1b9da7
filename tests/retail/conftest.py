"""Retail fixtures: the τ²-bench data (fetched once per machine) and a rollout that runs tools directly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.sdk import Base
from tests.retail.rollout import Rollout
from tools.retail import data, pack

REPO_ROOT = Path(__file__).resolve().parents[2]
# The cache `make run` uses too (SPARRING_HOME defaults to .sparring): the download happens once.
HOME = REPO_ROOT / ".sparring"


@pytest.fixture(scope="session", autouse=True)
def retail_data() -> Path:
    directory = data.DATA.fetch(data.DATA.cache_dir(HOME))
    data.DATA.locate(None, HOME)
    return directory


@pytest.fixture(autouse=True)
def restore_data_location(retail_data: Path) -> Iterator[None]:
    """A test that starts a server or a command reconfigures where the data is: point it back after."""
    yield
    data.DATA.locate(None, HOME)


@pytest.fixture(scope="session")
def raw_db(retail_data: Path) -> dict[str, Any]:
    """db.json exactly as shipped, to compute expected values from independently of the tools."""
    loaded: dict[str, Any] = json.loads((retail_data / "db.json").read_text())
    return loaded


@pytest.fixture(scope="session")
def base(retail_data: Path) -> Base:
    return pack.base()


@pytest.fixture
def rollout(base: Base) -> Rollout:
    return Rollout(base)
