"""`sparring grade` and `sparring regrade`: the server's graders, run from the command line."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from asgi_lifespan import LifespanManager
from typer.testing import CliRunner

from app.auth import ensure_local_admin_key
from app.cli import cli
from app.config import get_settings
from app.main import create_app
from tests.conftest import call_body

GRADERS = {
    "answered": {
        "type": "string_check",
        "name": "answered",
        "operation": "ne",
        "input": "{{ sample.output_text }}",
        "reference": "",
    },
    "exact": {
        "type": "string_check",
        "name": "exact",
        "operation": "eq",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.reference_answer }}",
    },
    "echoed": {"type": "required_tools", "name": "echoed", "tools": ["echo"]},
    "both": {
        "type": "multi",
        "name": "both",
        "graders": {
            "exact": {
                "type": "string_check",
                "name": "exact",
                "operation": "eq",
                "input": "{{ sample.output_text }}",
                "reference": "{{ item.reference_answer }}",
            },
            "fuzzy": {
                "type": "text_similarity",
                "name": "fuzzy",
                "input": "{{ sample.output_text }}",
                "reference": "{{ item.reference_answer }}",
                "evaluation_metric": "fuzzy_match",
            },
        },
        "calculate_output": "0.5 * exact + 0.5 * fuzzy",
    },
}


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    graders = tmp_path / "graders.yaml"
    graders.write_text(yaml.safe_dump(GRADERS))
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPARRING_PACKS", "demo")
    monkeypatch.setenv("SPARRING_GRADERS_FILE", str(graders))
    for name in ("SPARRING_DATABASE_URL", "SPARRING_REDIS_URL", "SPARRING_DEFAULT_GRADER"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def write(path: Path, data: object) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_grade_prints_the_score_and_every_sub_score(env: Path) -> None:
    sample = write(env / "sample.json", {"output_text": "Paris, France"})
    item = write(env / "item.json", {"reference_answer": "Paris"})
    result = CliRunner().invoke(cli, ["grade", "--grader", "both", "--sample", sample, "--item", item])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("grader  both (version ")
    score = float(lines[1].split()[1])
    subs = {line.split()[0]: float(line.split()[1]) for line in lines[2:4]}
    assert subs["exact"] == 0.0 and 0.0 < subs["fuzzy"] < 1.0
    assert score == pytest.approx(0.5 * subs["fuzzy"], abs=1e-5)


def test_grade_explains_bad_input(env: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(cli, ["grade", "--grader", "exact", "--sample", str(env / "none.json")])
    assert missing.exit_code == 2 and "cannot read the sample file" in missing.output
    (env / "bad.json").write_text("{not json")
    bad = runner.invoke(cli, ["grade", "--grader", "exact", "--item", str(env / "bad.json")])
    assert bad.exit_code == 2 and "not valid JSON" in bad.output
    unknown = runner.invoke(cli, ["grade", "--grader", "nope"])
    assert unknown.exit_code == 1 and "no grader named 'nope'" in unknown.output


def test_a_bad_graders_file_is_refused_with_the_grader_and_field(env: Path) -> None:
    (env / "graders.yaml").write_text(yaml.safe_dump({"x": {"type": "string_check", "name": "x"}}))
    result = CliRunner().invoke(cli, ["grade", "--grader", "x"])
    assert result.exit_code == 2
    assert "grader 'x'" in result.output and "graders.yaml" in result.output


def test_regrade_reports_what_changed(env: Path) -> None:
    runner = CliRunner()
    upgraded = runner.invoke(cli, ["db", "upgrade"])
    assert upgraded.exit_code == 0, upgraded.output
    result = runner.invoke(cli, ["regrade", "--grader", "exact"])
    assert result.exit_code == 0, result.output
    assert "regraded 0 of 0 rollouts with exact" in result.output and "mean - -> -" in result.output


def test_regrade_scores_a_run_with_a_grader_that_never_graded_it(env: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(cli, ["db", "upgrade"]).exit_code == 0
    seeded = runner.invoke(cli, ["seed-rollouts", "--run", "lab", "--rollouts", "60", "--items", "6"])
    assert seeded.exit_code == 0, seeded.output
    dry = runner.invoke(cli, ["regrade", "--grader", "answered", "--run", "lab", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "would regrade 60 rollouts with answered" in dry.output
    done = runner.invoke(cli, ["regrade", "--grader", "answered", "--run", "lab"])
    assert done.exit_code == 0, done.output
    assert "regraded 60 of 60 rollouts with answered" in done.output
    assert "60 scores new or changed, 0 failed, 0 skipped" in done.output
    # Its grades stand beside the seeded ones: a second regrade changes nothing.
    again = runner.invoke(cli, ["regrade", "--grader", "answered", "--run", "lab"])
    assert (
        "regraded 60 of 60 rollouts with answered" in again.output
        and "0 scores new or changed" in again.output
    )


async def _echo_logged(key: str, trace_id: str) -> None:
    """One answered `echo` call of the rollout, logged in the database the command reads."""
    settings = get_settings()
    app = create_app(settings)
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sparring") as client:
            response = await client.post(
                "/tools/echo",
                json=call_body('{"text": "hi"}', trace_id=trace_id, call_id="c1"),
                headers={"Authorization": f"Bearer {key}"},
            )
            assert response.status_code == 200, response.text


def test_grade_reads_a_rollout_by_the_trace_id_it_was_called_with(env: Path) -> None:
    """A trace_id longer than the log's column is keyed as the tool routes key it, so the command finds
    the rollout's calls (not an empty rollout, which `required_tools` scores 0)."""
    runner = CliRunner()
    assert runner.invoke(cli, ["db", "upgrade"]).exit_code == 0
    key, _ = ensure_local_admin_key(env / "home")
    for trace_id in ("trace_short", "trace_" + "x" * 300):
        asyncio.run(_echo_logged(key, trace_id))
        result = runner.invoke(cli, ["grade", "--grader", "echoed", "--trace-id", trace_id])
        assert result.exit_code == 0, result.output
        assert float(result.output.splitlines()[1].split()[1]) == 1.0, (trace_id, result.output)
