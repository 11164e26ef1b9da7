"""transcripts: a rollout's conversation (model turns, tool calls and results, user turns)

Revision ID: 0009_transcripts
Revises: 0008_grader_lab
Create Date: 2026-12-05

Stored when sparring runs the loop (eval, canary, remote rollouts, the client's episodes) or when a
trainer PUTs one (`PUT /rollouts/{trace_id}/transcript`); shown on the review's rollout page.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0009_transcripts"
down_revision: str | None = "0008_grader_lab"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine[object]:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "transcripts",
        sa.Column("trace_id", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=True),
        sa.Column("source", sa.String(length=200), nullable=True),
        sa.Column("messages", _json(), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("stored_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("trace_id", name=op.f("pk_transcripts")),
    )


def downgrade() -> None:
    op.drop_table("transcripts")
