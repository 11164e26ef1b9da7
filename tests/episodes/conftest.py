"""Episode fixtures: the retail data (fetched once per machine) and an app serving the retail pack."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ors.client import AsyncORS
from typer.testing import CliRunner

from app.cli import cli
from app.config import get_settings
from tests.conftest import TOOLS_KEY, AppFactory
from tests.retail import corpus
from tools.retail import pack as retail_pack


# The ORS tests' clients of the app their module serves at `url`: plain HTTP and the official SDK.
@pytest.fixture
async def http(url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": TOOLS_KEY}, timeout=60) as client:
        yield client


@pytest.fixture
async def ors(url: str) -> AsyncIterator[AsyncORS]:
    client = AsyncORS(base_url=url, api_key=TOOLS_KEY)
    yield client
    for session in client.environments._clients.values():
        await session.close()


@pytest.fixture(scope="session")
def retail_data() -> Path:
    return corpus.fetch()


@pytest.fixture
async def retail(app_factory: AppFactory, retail_data: Path) -> AsyncIterator[httpx.AsyncClient]:
    """An app serving the retail pack on the backend under test (tools key in the client's headers)."""
    async with app_factory(packs=[retail_pack], pack_settings={"retail": {"data": retail_data}}) as client:
        yield client


def gold_answer(row: dict[str, Any]) -> str:
    """A final answer that states every fact the task asks to communicate."""
    return "Done. " + " and ".join(row.get("communicate_info", []))


@pytest.fixture
def built_test_split(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, retail_data: Path
) -> list[dict[str, object]]:
    """`sparring dataset build retail --split test`, run as the command."""
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "cli-home"))
    monkeypatch.setenv("SPARRING_RETAIL_DATA", str(retail_data))
    get_settings.cache_clear()
    out = tmp_path / "test.jsonl"
    try:
        result = CliRunner().invoke(cli, ["dataset", "build", "retail", "--split", "test", "--out", str(out)])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in out.read_text().splitlines()]
