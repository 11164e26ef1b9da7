"""The Task API's rows: exactly what `sparring dataset build` writes, in file order."""

from __future__ import annotations

import httpx
import pytest

from app.deps import app_state
from app.episodes.tasks import InvalidIndex, InvalidSplit, UnknownEnv, task_row, task_rows
from tests.conftest import AppFactory
from tests.packs import counter_pack


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_rows_are_the_dataset_build_lines_in_order(
    retail: httpx.AsyncClient, built_test_split: list[dict[str, object]]
) -> None:
    registry = app_state(retail.app).registry  # type: ignore[attr-defined]
    rows = task_rows("retail", "test", registry=registry)
    assert rows == built_test_split
    assert len(rows) == 40
    assert set(rows[0]) == {"messages", "tools", "task_id", "actions", "communicate_info", "user_simulator"}
    assert task_row("retail", "test", 39, registry=registry) == built_test_split[39]
    # Each call parses its own copy: a caller changing a row changes nobody else's.
    rows[0]["task_id"] = "changed"
    assert task_rows("retail", "test", registry=registry)[0] == built_test_split[0]


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_unknown_env_split_and_index_are_refused(retail: httpx.AsyncClient) -> None:
    registry = app_state(retail.app).registry  # type: ignore[attr-defined]
    with pytest.raises(UnknownEnv):
        task_rows("airline", "test", registry=registry)
    with pytest.raises(InvalidSplit) as split:
        task_rows("retail", "dev", registry=registry)
    assert split.value.status_code == 400 and split.value.body() == {"detail": "Invalid split"}
    for index in (40, -1):
        with pytest.raises(InvalidIndex) as bad:
            task_row("retail", "test", index, registry=registry)
        assert bad.value.body() == {"detail": "Invalid index"}


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_a_pack_without_a_dataset_has_no_split(app_factory: AppFactory) -> None:
    async with app_factory(packs=[counter_pack]) as client:
        registry = app_state(client.app).registry  # type: ignore[attr-defined]
        with pytest.raises(InvalidSplit):
            task_rows(counter_pack.name, "train", registry=registry)
