"""calls, rollouts and grades

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "grades",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("trace_id", sa.String(length=128), nullable=True),
        sa.Column("grader", sa.String(length=128), nullable=False),
        sa.Column("grader_version", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column(
            "sub_scores",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "flags",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "errors",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "sample",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("answer_hash", sa.String(length=64), nullable=True),
        sa.Column("item_key", sa.String(length=128), nullable=True),
        sa.Column("run", sa.String(length=200), nullable=True),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_grades")),
    )
    op.create_index(op.f("ix_grades_answer_hash"), "grades", ["answer_hash"], unique=False)
    op.create_index(op.f("ix_grades_grader"), "grades", ["grader"], unique=False)
    op.create_index("ix_grades_trace_created", "grades", ["trace_id", "created_at"], unique=False)
    op.create_table(
        "rollouts",
        sa.Column("trace_id", sa.String(length=128), nullable=False),
        sa.Column("run", sa.String(length=200), nullable=True),
        sa.Column("item_key", sa.String(length=128), nullable=True),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("graded_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("trace_id", name=op.f("pk_rollouts")),
    )
    op.create_index(op.f("ix_rollouts_item_key"), "rollouts", ["item_key"], unique=False)
    op.create_index(op.f("ix_rollouts_last_seen"), "rollouts", ["last_seen"], unique=False)
    op.create_index(op.f("ix_rollouts_run"), "rollouts", ["run"], unique=False)
    op.create_table(
        "tool_calls",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("trace_id", sa.String(length=128), nullable=False),
        sa.Column("call_id", sa.String(length=200), nullable=True),
        sa.Column("request_id", sa.String(length=200), nullable=True),
        sa.Column("tool", sa.String(length=128), nullable=False),
        sa.Column("arguments", sa.Text(), nullable=False),
        sa.Column("output", sa.Text(), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("worker", sa.String(length=128), nullable=False),
        sa.Column("run", sa.String(length=200), nullable=True),
        sa.Column("item_key", sa.String(length=128), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tool_calls")),
    )
    op.create_index(op.f("ix_tool_calls_outcome"), "tool_calls", ["outcome"], unique=False)
    op.create_index("ix_tool_calls_tool_started", "tool_calls", ["tool", "started_at"], unique=False)
    op.create_index("ix_tool_calls_trace_started", "tool_calls", ["trace_id", "started_at"], unique=False)
    op.create_index(
        "uq_tool_calls_answered",
        "tool_calls",
        ["trace_id", "call_id"],
        unique=True,
        postgresql_where=sa.text("call_id IS NOT NULL AND outcome IN ('ok', 'model_error')"),
        sqlite_where=sa.text("call_id IS NOT NULL AND outcome IN ('ok', 'model_error')"),
    )


def downgrade() -> None:
    op.drop_index(
        "uq_tool_calls_answered",
        table_name="tool_calls",
        postgresql_where=sa.text("call_id IS NOT NULL AND outcome IN ('ok', 'model_error')"),
        sqlite_where=sa.text("call_id IS NOT NULL AND outcome IN ('ok', 'model_error')"),
    )
    op.drop_index("ix_tool_calls_trace_started", table_name="tool_calls")
    op.drop_index("ix_tool_calls_tool_started", table_name="tool_calls")
    op.drop_index(op.f("ix_tool_calls_outcome"), table_name="tool_calls")
    op.drop_table("tool_calls")
    op.drop_index(op.f("ix_rollouts_run"), table_name="rollouts")
    op.drop_index(op.f("ix_rollouts_last_seen"), table_name="rollouts")
    op.drop_index(op.f("ix_rollouts_item_key"), table_name="rollouts")
    op.drop_table("rollouts")
    op.drop_index("ix_grades_trace_created", table_name="grades")
    op.drop_index(op.f("ix_grades_grader"), table_name="grades")
    op.drop_index(op.f("ix_grades_answer_hash"), table_name="grades")
    op.drop_table("grades")
