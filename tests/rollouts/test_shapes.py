"""The one family of rollout shapes: derived columns, the call count's name, one detail for both paths."""

from __future__ import annotations

import dataclasses

from app.calls.log_writer import CallRecord
from app.db.models import LOGGED_CALL_COLUMNS, LOGGED_ROLLOUT_COLUMNS, RolloutRow, ToolCall
from app.rollouts.shapes import LOGGED_CALL_FIELDS, RolloutBase, RolloutDetail, RolloutSummary


def test_the_writer_fills_every_column_of_a_logged_call_and_nothing_else() -> None:
    columns = {name for name, _ in LOGGED_CALL_COLUMNS}
    assert columns == {c.name for c in ToolCall.__table__.columns} - {"id"}
    assert columns == {f.name for f in dataclasses.fields(CallRecord)}
    assert dict(LOGGED_CALL_COLUMNS)["started_at"] == "timestamp with time zone"
    assert dict(LOGGED_CALL_COLUMNS)["tool"] == "varchar"  # no length: an over-long value is refused


def test_the_writer_upserts_a_rollout_without_its_grading_time_and_count() -> None:
    names = [name for name, _ in LOGGED_ROLLOUT_COLUMNS]
    assert names == ["trace_id", "run", "item_key", "first_seen", "last_seen", "channel"]
    assert set(names) < {c.name for c in RolloutRow.__table__.columns}


def test_a_logged_call_reads_every_stored_field_it_shows() -> None:
    assert set(LOGGED_CALL_FIELDS) <= {c.name for c in ToolCall.__table__.columns}


def test_summary_and_detail_share_the_base_and_count_calls_as_call_count() -> None:
    base = set(RolloutBase.model_fields)
    assert "call_count" in base and "calls" not in base
    assert base <= set(RolloutSummary.model_fields) and base <= set(RolloutDetail.model_fields)
    assert set(RolloutDetail.model_fields) - base == {"parallel_batches", "timeline", "grades", "transcript"}
    assert "calls" not in RolloutSummary.model_fields and "calls" not in RolloutDetail.model_fields
