"""Episode fixtures: the retail data (fetched once per machine) and an app serving the retail pack."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import AppFactory
from tests.retail import corpus
from tools.retail import pack as retail_pack


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
