"""call attempts: every attempt of a tool call its own row, named by an attempt id; no unique answered row

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05

A logged row was a call's answered row (unique per trace_id and call_id) or a failed attempt. Now
every attempt has its own row (a replay of the ledger too, outcome `replayed`), and which one is the
call's answer is read (app/db/call_log.py). The rows logged before are attempts already: each gets an
attempt id of its own, and the counts stay as they are (no call had two answered rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ANSWERED_ROW = "call_id IS NOT NULL AND outcome IN ('ok', 'model_error')"
_ANSWERS = "('ok', 'model_error', 'replayed')"


def upgrade() -> None:
    op.drop_index(
        "uq_tool_calls_answered",
        table_name="tool_calls",
        postgresql_where=sa.text(_ANSWERED_ROW),
        sqlite_where=sa.text(_ANSWERED_ROW),
    )
    with op.batch_alter_table("tool_calls") as batch:
        batch.add_column(sa.Column("attempt_id", sa.String(length=32), nullable=True))
    # Server-made ids are 32 hex digits; these cannot meet one.
    op.execute("UPDATE tool_calls SET attempt_id = 'row-' || CAST(id AS VARCHAR)")
    with op.batch_alter_table("tool_calls") as batch:
        batch.alter_column("attempt_id", existing_type=sa.String(length=32), nullable=False)
    op.create_index("ix_tool_calls_trace_call", "tool_calls", ["trace_id", "call_id"], unique=False)


def downgrade() -> None:
    # Back to one answered row per call: the answer as read stays (a replay that answered becomes the
    # outcome it replayed, told by its error), at the call's first start; the answers it superseded go.
    op.execute(
        f"""
        DELETE FROM tool_calls
        WHERE call_id IS NOT NULL AND outcome IN {_ANSWERS} AND EXISTS (
            SELECT 1 FROM tool_calls b
            WHERE b.trace_id = tool_calls.trace_id AND b.call_id = tool_calls.call_id
              AND b.outcome IN {_ANSWERS}
              AND (CASE WHEN b.outcome = 'replayed' THEN 0 ELSE 1 END, b.started_at, b.id)
                > (CASE WHEN tool_calls.outcome = 'replayed' THEN 0 ELSE 1 END, tool_calls.started_at,
                   tool_calls.id))
        """
    )
    op.execute(
        "UPDATE tool_calls SET outcome = CASE WHEN error IS NULL THEN 'ok' ELSE 'model_error' END "
        "WHERE outcome = 'replayed'"
    )
    op.execute(
        f"""
        UPDATE tool_calls SET started_at = (
            SELECT min(f.started_at) FROM tool_calls f
            WHERE f.trace_id = tool_calls.trace_id AND f.call_id = tool_calls.call_id)
        WHERE {_ANSWERED_ROW}
        """
    )
    op.drop_index("ix_tool_calls_trace_call", table_name="tool_calls")
    with op.batch_alter_table("tool_calls") as batch:
        batch.drop_column("attempt_id")
    op.create_index(
        "uq_tool_calls_answered",
        "tool_calls",
        ["trace_id", "call_id"],
        unique=True,
        postgresql_where=sa.text(_ANSWERED_ROW),
        sqlite_where=sa.text(_ANSWERED_ROW),
    )
