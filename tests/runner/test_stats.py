"""pass@k, pass^k and clustered standard errors (sparring.stats), the report's figures built on them,
and the export (sparring.export) as Hugging Face `datasets` loads it."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from datasets import load_dataset
from hypothesis import given
from hypothesis import strategies as st

from sparring.evaluate import FinishedRollout
from sparring.export import FIELDS, export_features, write_export
from sparring.report import build_report, format_report
from sparring.stats import clustered_stderr, mean_stderr, pass_at_k, pass_hat_k, pass_table


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_the_estimators_are_the_averages_over_every_k_subset(case: tuple[int, int, int]) -> None:
    n, c, k = case
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_hat_k(n, c, k) == pytest.approx(sum(all(s) for s in subsets) / len(subsets))


def test_impossible_counts_are_refused() -> None:
    for n, c, k in ((3, 4, 1), (3, 1, 4), (3, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_the_standard_error_is_clustered_by_item() -> None:
    # Independent values: s / sqrt(n).
    assert mean_stderr([1.0, 0.0, 1.0, 0.0]) == pytest.approx(math.sqrt(1 / 3) / 2)
    # The same four values as two items that always agree with themselves: half the information.
    assert clustered_stderr([[1.0, 1.0], [0.0, 0.0]]) == pytest.approx(0.5)
    assert clustered_stderr([[1.0, 0.0], [1.0, 0.0]]) == pytest.approx(0.0)
    assert clustered_stderr([[1.0, 0.0, 1.0]]) is None  # one item says nothing about the spread


def test_pass_table_counts_only_items_with_k_rollouts() -> None:
    rows = pass_table({"a": [1.0, 1.0, 0.0], "b": [0.0], "c": [0.4, 0.6]}, threshold=0.5)
    assert [(r["k"], r["items"]) for r in rows] == [(1, 3), (2, 2), (3, 1)]
    assert rows[0]["pass_at_k"] == pytest.approx((2 / 3 + 0 + 1 / 2) / 3)
    assert rows[1]["pass_at_k"] == pytest.approx((1 + 1) / 2)
    assert rows[1]["pass_hat_k"] == pytest.approx((1 / 3 + 0) / 2)
    assert rows[2]["pass_at_k_stderr"] is None


def record(item: str, sample: int, score: float | None, discarded: str | None = None) -> FinishedRollout:
    return FinishedRollout(
        item_key=item, sample=sample, policy="model", trace_id=f"trace_{item}_{sample}", score=score,
        discarded=discarded, ended_by="answer", calls=2, tool_errors=0, input_tokens=10,
        output_tokens=5, duration_s=0.25,
    )  # fmt: skip


RECORDS = [
    record("a", 0, 1.0),
    record("a", 1, 1.0),
    record("b", 0, 1.0),
    record("b", 1, 0.0),
    record("c", 0, None, "model_error: HTTP 503"),
]


def test_the_report_has_pass_at_k_and_standard_errors() -> None:
    report = build_report(
        RECORDS, run="r", review_url=None, planned=5, resumed=0, wall_time_s=1.0, interrupted=False
    )
    assert report["reward"]["mean"] == pytest.approx(0.75)
    assert report["reward"]["stderr"] == pytest.approx(0.25)
    by_k = report["pass"]["by_k"]
    assert [(r["k"], r["items"]) for r in by_k] == [(1, 2), (2, 2)]
    assert by_k[0]["pass_at_k"] == pytest.approx(0.75) and by_k[0]["pass_at_k_stderr"] == pytest.approx(0.25)
    assert by_k[1]["pass_at_k"] == pytest.approx(1.0) and by_k[1]["pass_hat_k"] == pytest.approx(0.5)
    screen = format_report(report)
    assert "0.750 ± 0.250" in screen
    assert any(line.startswith("pass@2") and "pass^2 0.500 ± 0.500" in line for line in screen.splitlines())


def test_the_export_loads_as_a_hugging_face_dataset_with_a_stable_schema(tmp_path: Path) -> None:
    out = tmp_path / "export.jsonl"
    assert write_export(RECORDS, out, run="r1", model="m", pass_threshold=0.5) == 5
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [list(row) for row in rows] == [list(FIELDS)] * 5
    loaded = load_dataset("json", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded.num_rows == 5 and loaded.column_names == list(FIELDS)
    types = {name: feature.dtype for name, feature in loaded.features.items()}
    assert types["score"] == "float64" and types["passed"] == "bool" and types["sample"] == "int64"
    assert loaded["passed"] == [True, True, True, False, None]
    assert loaded["discarded"][4] == "model_error: HTTP 503" and loaded["score"][4] is None
    # A run without discards has the same features: scores stay floats even when all are 1.
    again = tmp_path / "all-graded.jsonl"
    write_export(RECORDS[:2], again, run="r2", model="m", pass_threshold=0.5)
    loaded_again = load_dataset("json", data_files=str(again), split="train", cache_dir=str(tmp_path / "hf"))
    assert loaded_again.features["score"].dtype == "float64"
    assert loaded_again.column_names == list(FIELDS)
    # Several runs load together with the documented schema.
    both = load_dataset(
        "json",
        data_files=[str(again), str(out)],
        split="train",
        features=export_features(),
        cache_dir=str(tmp_path / "hf"),
    )
    assert both.num_rows == 7 and both["run"] == ["r2"] * 2 + ["r1"] * 5
    assert both.features == export_features()
