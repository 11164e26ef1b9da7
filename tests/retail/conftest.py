"""Retail fixtures: the τ²-bench data (fetched once per machine) and a rollout that runs tools directly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.sdk import Base
from tests.retail import corpus
from tests.retail.corpus import HOME as HOME
from tests.retail.rollout import Rollout


@pytest.fixture(scope="session", autouse=True)
def retail_data() -> Path:
    return corpus.fetch()


@pytest.fixture(scope="session")
def raw_db(retail_data: Path) -> dict[str, Any]:
    """db.json exactly as shipped, to compute expected values from independently of the tools."""
    loaded: dict[str, Any] = json.loads((retail_data / "db.json").read_text())
    return loaded


@pytest.fixture(scope="session")
def base(retail_data: Path) -> Base:
    return corpus.store()


@pytest.fixture
def rollout(base: Base) -> Rollout:
    return Rollout(base)
