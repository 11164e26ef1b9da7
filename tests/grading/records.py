"""Builders of rollout records and grade inputs for the grading tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from app.grading.graders.model import GradeInput, RolloutRecord
from app.rollouts.shapes import RolloutCall

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def rollout_call(
    seq: int,
    tool: str = "lookup",
    arguments: Any = "{}",
    output: str | None = "{}",
    outcome: str = "ok",
    *,
    batch: int | None = None,
    started_at: datetime | None = None,
    ended_at: datetime | None = None,
) -> RolloutCall:
    """One logged call in the shape the server reads back (arguments other than text are sent as JSON)."""
    start = started_at or T0 + timedelta(seconds=seq)
    return RolloutCall(
        seq=seq,
        batch=seq if batch is None else batch,
        tool=tool,
        call_id=f"call_{seq}",
        arguments=arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode(),
        output=output,
        output_bytes=len(output.encode()) if output is not None else 0,
        outcome=outcome,
        error=output if outcome == "model_error" else None,
        status_code={"tool_crash": 500, "infra_error": 503}.get(outcome, 200),
        started_at=start,
        ended_at=ended_at or start + timedelta(milliseconds=100),
        latency_ms=100.0,
        worker="test",
    )


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
    recorded: list[RolloutCall] = []
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
            rollout_call(
                seq,
                c["tool"],
                c["arguments"],
                c["output"],
                c["outcome"],
                batch=batch,
                started_at=T0 + timedelta(seconds=start),
                ended_at=T0 + timedelta(seconds=end),
            ).model_copy(update={"latency_ms": c["duration"] * 1000})
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
