"""`sparring eval --export FILE`: a run's rollouts as JSON Lines in one stable schema, one line per
rollout, which `datasets.load_dataset("json", data_files=FILE)` loads as a Hugging Face dataset.

Every line has every field, in this order and of one type (a float score even when it is 1; `null`
where a rollout has no value). One file loads as it is; to load several runs together (where a run
without discards has only nulls in `discarded`), give the loader the schema:
`load_dataset("json", data_files=[...], features=export_features())`.

| field | type | |
|---|---|---|
| `run` | string | the run label (`--run`) |
| `model` | string | the model evaluated |
| `item` | string | the dataset line's key (`id`, `task_id`, else a hash of the line) |
| `sample` | int64 | which of the item's `--samples` rollouts (0-based) |
| `trace_id` | string | the rollout's trace id (its review page) |
| `score` | float64 or null | the grader's reward; null when the rollout was discarded |
| `passed` | bool or null | `score >= pass_threshold`; null when discarded |
| `pass_threshold` | float64 | the threshold `passed` used (`--pass-threshold`) |
| `discarded` | string or null | why the rollout was not graded (`model_error: ...`, `tool_failed: ...`) |
| `ended_by` | string | how the episode ended (`answer`, `max_turns`, `max_tool_calls`, ...) |
| `tool_calls`, `tool_errors` | int64 | tool calls made, and how many answered `Error: ...` |
| `input_tokens`, `output_tokens` | int64 | the model's usage over the rollout |
| `duration_s` | float64 | the rollout's wall time |
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sparring.evaluate import FinishedRollout

# Each field and its Arrow type, in the order of a line.
DTYPES = {
    "run": "string",
    "model": "string",
    "item": "string",
    "sample": "int64",
    "trace_id": "string",
    "score": "float64",
    "passed": "bool",
    "pass_threshold": "float64",
    "discarded": "string",
    "ended_by": "string",
    "tool_calls": "int64",
    "tool_errors": "int64",
    "input_tokens": "int64",
    "output_tokens": "int64",
    "duration_s": "float64",
}
FIELDS = tuple(DTYPES)


def export_features() -> Any:
    """The export's schema as Hugging Face `datasets.Features` (needs `datasets` installed)."""
    from datasets import Features, Value  # type: ignore[import-untyped]

    return Features({name: Value(dtype) for name, dtype in DTYPES.items()})


def export_row(record: FinishedRollout, *, run: str, model: str, pass_threshold: float) -> dict[str, Any]:
    """One rollout as an export line (the fields of FIELDS, in order)."""
    score = float(record.score) if record.graded and record.score is not None else None
    row = {
        "run": run,
        "model": model,
        "item": record.item_key,
        "sample": record.sample,
        "trace_id": record.trace_id,
        "score": score,
        "passed": None if score is None else score >= pass_threshold,
        "pass_threshold": float(pass_threshold),
        "discarded": record.discarded,
        "ended_by": record.ended_by,
        "tool_calls": record.calls,
        "tool_errors": record.tool_errors,
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
        "duration_s": float(record.duration_s),
    }
    return {name: row[name] for name in FIELDS}


def write_export(
    records: Iterable[FinishedRollout], out: Path, *, run: str, model: str, pass_threshold: float
) -> int:
    """Write the rollouts (by item, then sample) as JSON Lines to `out`; the number of lines."""
    ordered = sorted(records, key=lambda r: (r.item_key, r.sample, r.policy))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for record in ordered:
            row = export_row(record, run=run, model=model, pass_threshold=pass_threshold)
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(ordered)
