"""grader lab: kept final states of rollouts, and people's labels of rollouts

Revision ID: 0008_grader_lab
Revises: 0007
Create Date: 2026-12-05

`kept_states` holds a rollout's final state (its changes against the packs' base data) once it is
graded, so a grader that reads state can score it again after the state store let it go.
`rollout_labels` holds a reviewer's pass/fail judgment of a rollout, with a note.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008_grader_lab"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine[object]:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "kept_states",
        sa.Column("trace_id", sa.String(length=128), nullable=False),
        sa.Column("changes", _json(), nullable=False),
        sa.Column("kept_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("trace_id", name=op.f("pk_kept_states")),
    )
    op.create_table(
        "rollout_labels",
        sa.Column("trace_id", sa.String(length=128), nullable=False),
        sa.Column("label", sa.String(length=8), nullable=False),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("labelled_by", sa.String(length=32), nullable=False),
        sa.Column("labelled_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("trace_id", name=op.f("pk_rollout_labels")),
    )
    op.create_index(op.f("ix_rollout_labels_label"), "rollout_labels", ["label"])


def downgrade() -> None:
    op.drop_index(op.f("ix_rollout_labels_label"), table_name="rollout_labels")
    op.drop_table("rollout_labels")
    op.drop_table("kept_states")
