"""channel of each call and rollout: rft (the tool routes) or mcp (the MCP server)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Every call logged before this revision came through the tool routes.
    with op.batch_alter_table("tool_calls") as batch:
        batch.add_column(sa.Column("channel", sa.String(length=16), server_default="rft", nullable=False))
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("channel", sa.String(length=16), nullable=True))
    op.execute("UPDATE rollouts SET channel = 'rft'")
    op.create_index(op.f("ix_rollouts_channel"), "rollouts", ["channel"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_rollouts_channel"), table_name="rollouts")
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_column("channel")
    with op.batch_alter_table("tool_calls") as batch:
        batch.drop_column("channel")
