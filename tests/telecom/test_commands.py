"""`sparring packs fetch telecom` and `sparring dataset build telecom` (τ²-bench's base split)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.config import get_settings
from tools.telecom import pack


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, telecom_data: Path) -> Iterator[Path]:
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPARRING_TELECOM_DATA", str(telecom_data))
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def test_fetch_reports_the_pack_ready(env: Path) -> None:
    result = CliRunner().invoke(cli, ["packs", "fetch", "telecom"])
    assert result.exit_code == 0, result.output
    assert "pack 'telecom' is ready" in result.output


@pytest.mark.parametrize(("split", "count"), [("train", 74), ("test", 40)])
def test_dataset_build_writes_the_base_split(env: Path, split: str, count: int, telecom_data: Path) -> None:
    out = env / f"{split}.jsonl"
    result = CliRunner().invoke(cli, ["dataset", "build", "telecom", "--split", split, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {count} lines to {out}" in result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    wanted = json.loads((telecom_data / "split_tasks.json").read_text())[split]
    assert [line["task_id"] for line in lines] == wanted
    first = lines[0]
    assert [m["role"] for m in first["messages"]] == ["developer", "user"]
    policy = first["messages"][0]["content"]
    assert (telecom_data / "main_policy.md").read_text() in policy
    assert policy.endswith((telecom_data / "tech_support_manual.md").read_text() + "\n</tech_support_policy>")
    # Only the agent's tools: the phone's are the simulated user's.
    assert [tool["function"]["name"] for tool in first["tools"]] == list(pack.tools)
    assert {"actions", "reward_basis", "user_simulator"} <= first.keys()
    # The simulated user's: τ²'s scenario, both guidelines, and the phone's tools it calls.
    user = first["user_simulator"]
    assert user["scenario"]["instructions"]["reason_for_call"]
    assert user["guidelines"] == (telecom_data / "simulation_guidelines.md").read_text()
    assert user["guidelines_tools"] == (telecom_data / "simulation_guidelines_tools.md").read_text()
    assert [tool["function"]["name"] for tool in user["tools"]] == list(pack.user_tools)


def test_dataset_build_refuses_an_unknown_split(env: Path) -> None:
    result = CliRunner().invoke(
        cli, ["dataset", "build", "telecom", "--split", "base", "--out", str(env / "x")]
    )
    assert result.exit_code == 2 and "unknown split 'base'" in result.output
