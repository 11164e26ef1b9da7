"""`sparring job-config` refuses to print a config a fine-tuning job would fail on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from app.cli import cli
from app.config import get_settings

EXACT = {
    "type": "string_check",
    "name": "exact",
    "operation": "eq",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.reference_answer }}",
}


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("SPARRING_PACKS", "demo")
    for name in ("SPARRING_AUTH_HEADER", "SPARRING_GRADERS_FILE", "SPARRING_DEFAULT_GRADER"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def graders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, names: list[str]) -> None:
    path = tmp_path / "graders.yaml"
    path.write_text(yaml.safe_dump({name: {**EXACT, "name": name} for name in names}))
    monkeypatch.setenv("SPARRING_GRADERS_FILE", str(path))
    get_settings.cache_clear()


def job_config(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["job-config", "--base-url", "https://rft.example.com", *args])
    return result.exit_code, result.output


def grader_url(output: str) -> str:
    """The grader URL of a job-config: Foundry's (the default platform's) whole job holds it."""
    url: str = json.loads(output)["job"]["method"]["reinforcement"]["grader"]["url"]
    return url


def test_an_unknown_grader_is_an_error_naming_the_known_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    graders(monkeypatch, tmp_path, ["exact", "fuzzy"])
    code, output = job_config("--grader", "nope")
    assert code == 2 and "nope" in output and "exact" in output and "fuzzy" in output
    code, output = job_config("--grader", "fuzzy")
    assert code == 0, output
    assert grader_url(output) == "https://rft.example.com/grade/fuzzy"


def test_grade_without_a_default_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    graders(monkeypatch, tmp_path, ["exact", "fuzzy"])  # several graders, none the default
    code, output = job_config()
    assert code == 2 and "--grader" in output and "SPARRING_DEFAULT_GRADER" in output
    monkeypatch.setenv("SPARRING_DEFAULT_GRADER", "fuzzy")
    get_settings.cache_clear()
    code, output = job_config()
    assert code == 0, output
    assert grader_url(output) == "https://rft.example.com/grade"


def test_no_grader_at_all_is_an_error() -> None:
    code, output = job_config()
    assert code == 2 and "no grader" in output


def test_one_grader_is_the_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    graders(monkeypatch, tmp_path, ["exact"])
    code, output = job_config()
    assert code == 0, output
    assert grader_url(output) == "https://rft.example.com/grade"


def test_a_plain_http_base_url_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    graders(monkeypatch, tmp_path, ["exact"])
    result = CliRunner().invoke(cli, ["job-config", "--base-url", "http://rft.example.com"])
    assert result.exit_code == 2 and "https" in result.output
    allowed = CliRunner().invoke(cli, ["job-config", "--base-url", "http://127.0.0.1:8000", "--allow-http"])
    assert allowed.exit_code == 0, allowed.output


@pytest.mark.parametrize("threshold", ["nan", "inf", "-inf"])
def test_a_pass_threshold_that_is_not_a_number_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, threshold: str
) -> None:
    """It was printed as `NaN` or `Infinity`: not JSON, so the job could not be created from it."""
    graders(monkeypatch, tmp_path, ["exact"])
    code, output = job_config("--pass-threshold", threshold)
    assert code == 2 and "--pass-threshold" in output, output
    code, output = job_config("--pass-threshold", "0.5")
    assert (
        code == 0 and json.loads(output)["job"]["method"]["reinforcement"]["grader"]["pass_threshold"] == 0.5
    )


def enabled(monkeypatch: pytest.MonkeyPatch, packs: str) -> None:
    monkeypatch.setenv("SPARRING_PACKS", packs)
    get_settings.cache_clear()


def reinforcement_tools(output: str) -> list[dict[str, object]]:
    tools: list[dict[str, object]] = json.loads(output)["job"]["method"]["reinforcement"]["tools"]
    return tools


def test_a_packs_own_grader_picks_that_packs_tools_at_its_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    enabled(monkeypatch, "demo,retail,code")
    code, output = job_config("--grader", "retail")
    assert code == 0, output
    tools = reinforcement_tools(output)
    names = {str(tool["name"]) for tool in tools}
    assert "echo" not in names and "run_python" not in names
    assert {"get_user_details", "cancel_pending_order", "calculate"} <= names
    assert all(str(t["server_url"]).startswith("https://rft.example.com/packs/retail/tools/") for t in tools)
    # --pack still decides when given
    code, output = job_config("--grader", "retail", "--pack", "demo")
    assert code == 0, output
    assert [t["name"] for t in reinforcement_tools(output)] == ["echo", "add_note", "list_notes"]


def test_dataset_tools_follow_the_grader_or_the_pack(monkeypatch: pytest.MonkeyPatch) -> None:
    enabled(monkeypatch, "demo,retail")
    runner = CliRunner()
    result = runner.invoke(cli, ["dataset-tools", "--grader", "retail"])
    assert result.exit_code == 0, result.output
    names = {tool["function"]["name"] for tool in json.loads(result.stdout)}
    assert "echo" not in names and "get_order_details" in names
    result = runner.invoke(cli, ["dataset-tools", "--pack", "demo"])
    demo = {tool["function"]["name"] for tool in json.loads(result.stdout)}
    assert demo == {"echo", "add_note", "list_notes"}
    result = runner.invoke(cli, ["dataset-tools", "--grader", "nope"])
    assert result.exit_code == 2 and "nope" in result.output and "retail" in result.output
    result = runner.invoke(cli, ["dataset-tools", "--pack", "airline"])
    assert result.exit_code == 2 and "demo, retail" in result.output


def test_dataset_build_takes_the_pack_as_an_option(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["dataset", "build", "--pack", "demo", "--out", str(tmp_path / "d.jsonl")])
    assert result.exit_code == 2 and "demo" in result.output and "ships no dataset" in result.output
    result = runner.invoke(cli, ["dataset", "build", "retail", "--pack", "demo"])
    assert result.exit_code == 2 and "two packs" in result.output
    result = runner.invoke(cli, ["dataset", "build"])
    assert result.exit_code == 2 and "--pack" in result.output
