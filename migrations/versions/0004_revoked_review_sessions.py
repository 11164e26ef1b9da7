"""revoked review sessions: a logged-out login token is refused until it would have expired

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "revoked_review_sessions",
        sa.Column("nonce", sa.String(length=64), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("nonce", name=op.f("pk_revoked_review_sessions")),
    )
    op.create_index(
        op.f("ix_revoked_review_sessions_expires_at"), "revoked_review_sessions", ["expires_at"]
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_revoked_review_sessions_expires_at"), table_name="revoked_review_sessions")
    op.drop_table("revoked_review_sessions")
