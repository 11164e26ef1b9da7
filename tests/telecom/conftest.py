"""Telecom fixtures: the τ²-bench data (fetched once per machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.telecom import corpus


@pytest.fixture(scope="session", autouse=True)
def telecom_data() -> Path:
    return corpus.fetch()
