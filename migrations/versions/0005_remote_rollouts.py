"""remote rollouts: what trainers asked this server to run, with their outcome and the worker's lease

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql


revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine[object]:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "remote_rollouts",
        sa.Column("rollout_id", sa.String(200), nullable=False),
        sa.Column("trace_id", sa.String(128), nullable=False),
        sa.Column("run", sa.String(200), nullable=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("grader", sa.String(128), nullable=True),
        sa.Column("summary", _json(), nullable=False),
        sa.Column("request", _json(), nullable=False),
        sa.Column("worker", sa.String(128), nullable=False),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("rollout_id", name=op.f("pk_remote_rollouts")),
    )
    op.create_index(op.f("ix_remote_rollouts_trace_id"), "remote_rollouts", ["trace_id"])
    op.create_index("ix_remote_rollouts_status_lease", "remote_rollouts", ["status", "lease_until"])


def downgrade() -> None:
    op.drop_index("ix_remote_rollouts_status_lease", table_name="remote_rollouts")
    op.drop_index(op.f("ix_remote_rollouts_trace_id"), table_name="remote_rollouts")
    op.drop_table("remote_rollouts")
