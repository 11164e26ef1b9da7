"""Builders of rollout records and grade inputs for the grading tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from app.grading.model import GradeInput, RecordedCall, RolloutRecord

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def call(
    tool: str,
    arguments: Any = None,
    output: str = "",
    *,
    outcome: str = "ok",
    start: float | None = None,
    duration: float = 0.1,
) -> dict[str, Any]:
    """A call description; `rollout()` numbers them and lays them out in time (sequentially by default)."""
    return {
        "tool": tool,
        "arguments": {} if arguments is None else arguments,
        "output": output,
        "outcome": outcome,
        "start": start,
        "duration": duration,
    }


def rollout(
    calls: Sequence[Mapping[str, Any]] = (),
    *,
    state: Mapping[str, Any] | None = None,
    trace_id: str = "trace_test",
) -> RolloutRecord:
    recorded: list[RecordedCall] = []
    clock = 0.0
    batch, batch_end = -1, -1.0
    for seq, c in enumerate(calls):
        start = c["start"] if c["start"] is not None else clock
        end = start + c["duration"]
        clock = max(clock, end)
        if start >= batch_end:
            batch += 1
            batch_end = end
        else:
            batch_end = max(batch_end, end)
        recorded.append(
            RecordedCall(
                seq=seq,
                tool=c["tool"],
                arguments=c["arguments"],
                output=c["output"],
                outcome=c["outcome"],
                error=c["output"] if c["outcome"] == "model_error" else None,
                started_at=T0 + timedelta(seconds=start),
                ended_at=T0 + timedelta(seconds=end),
                latency_ms=c["duration"] * 1000,
                batch=batch,
            )
        )
    return RolloutRecord(
        trace_id=trace_id,
        calls=recorded,
        first_seen=recorded[0].started_at if recorded else None,
        last_seen=recorded[-1].ended_at if recorded else None,
        state=dict(state or {}),
    )


def grade_input(
    answer: str | None = None,
    item: Mapping[str, Any] | None = None,
    *,
    sample: Mapping[str, Any] | None = None,
    record: RolloutRecord | None = None,
) -> GradeInput:
    full_sample: dict[str, Any] = dict(sample or {})
    if answer is not None:
        full_sample["output_text"] = answer
    return GradeInput(
        sample=full_sample,
        item=dict(item or {}),
        trace_id=record.trace_id if record is not None else None,
        rollout=record,
    )
