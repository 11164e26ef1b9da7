"""`sparring packs fetch airline`, `sparring dataset build airline`, and the server finding its data."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.config import get_settings
from app.errors import StartupError
from tests.conftest import ADMIN_KEY, AppFactory, new_trace
from tools.airline import pack


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, airline_data: Path) -> Iterator[Path]:
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPARRING_AIRLINE_DATA", str(airline_data))
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def test_fetch_reports_the_pack_ready(env: Path) -> None:
    result = CliRunner().invoke(cli, ["packs", "fetch", "airline"])
    assert result.exit_code == 0, result.output
    assert "pack 'airline' is ready" in result.output


@pytest.mark.parametrize(("split", "count"), [("train", 30), ("test", 20)])
def test_dataset_build_writes_the_split(env: Path, split: str, count: int, airline_data: Path) -> None:
    out = env / f"{split}.jsonl"
    result = CliRunner().invoke(cli, ["dataset", "build", "airline", "--split", split, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {count} lines to {out}" in result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    wanted = json.loads((airline_data / "split_tasks.json").read_text())[split]
    assert [line["task_id"] for line in lines] == wanted
    first = lines[0]
    assert [m["role"] for m in first["messages"]] == ["developer", "user"]
    assert first["messages"][0]["content"].endswith((airline_data / "policy.md").read_text())
    assert [tool["function"]["name"] for tool in first["tools"]] == list(pack.tools)
    assert {"actions", "communicate_info", "reward_basis"} <= first.keys()


def test_dataset_build_refuses_an_unknown_split(env: Path) -> None:
    result = CliRunner().invoke(
        cli, ["dataset", "build", "airline", "--split", "base", "--out", str(env / "x")]
    )
    assert result.exit_code == 2 and "unknown split 'base'" in result.output


async def test_the_server_uses_the_operators_copy(app_factory: AppFactory, airline_data: Path) -> None:
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"airline": {"data": airline_data}}
    ) as client:
        response = await client.post(
            "/tools/get_flight_status",
            json={
                "call_id": "c",
                "trace_id": new_trace(),
                "arguments": {"flight_number": "HAT001", "date": "2024-05-01"},
            },
        )
    assert response.status_code == 200 and response.json()["output"] == "landed"


async def test_the_pack_reads_sparring_airline_data_from_the_environment(
    app_factory: AppFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "airline"
    empty.mkdir()
    monkeypatch.setenv("SPARRING_AIRLINE_DATA", str(empty))
    with pytest.raises(
        StartupError, match=f"the airline data directory {empty} .SPARRING_AIRLINE_DATA. lacks"
    ):
        async with app_factory(packs=[pack]):
            pass


async def test_new_ids_are_counted_per_rollout(app_factory: AppFactory, airline_data: Path) -> None:
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"airline": {"data": airline_data}}
    ) as client:

        async def certificate(trace: str, call_id: str) -> str:
            body = {
                "call_id": call_id,
                "trace_id": trace,
                "arguments": {"user_id": "mei_hernandez_8984", "amount": 100},
            }
            response = await client.post("/tools/send_certificate", json=body)
            assert response.status_code == 200, response.text
            output: str = response.json()["output"]
            return output

        trace, other_trace = new_trace(), new_trace()
        first = [await certificate(trace, "c1"), await certificate(trace, "c2")]
        other = await certificate(other_trace, "c1")
    assert [text.split()[1] for text in first] == ["certificate_3221322", "certificate_3221323"]
    assert other.split()[1] == "certificate_3221322"  # another rollout starts from the shipped database


async def test_a_baggage_charge_too_large_to_keep_is_an_error_on_every_backend(
    app_factory: AppFactory, airline_data: Path
) -> None:
    async with app_factory(
        packs=[pack], key=ADMIN_KEY, pack_settings={"airline": {"data": airline_data}}
    ) as client:

        async def send(name: str, call_id: str, arguments: dict[str, object]) -> str:
            body = {"call_id": call_id, "trace_id": trace, "arguments": arguments}
            response = await client.post(f"/tools/{name}", json=body)
            assert response.status_code == 200, response.text
            output: str = response.json()["output"]
            return output

        trace = new_trace()
        bags = {"reservation_id": "R9QDGB", "total_baggages": 0, "payment_id": "credit_card_2140654"}
        # 9 * 10**18 paid bags at $50: an amount no 64-bit integer holds.
        huge = await send("update_reservation_baggages", "c1", {**bags, "nonfree_baggages": 9 * 10**18})
        one = json.loads(await send("update_reservation_baggages", "c2", {**bags, "nonfree_baggages": 1}))
    assert huge == "Error: Payment amount is too large"
    assert one["nonfree_baggages"] == 1
    assert one["payment_history"][-1] == {"payment_id": "credit_card_2140654", "amount": 50}
