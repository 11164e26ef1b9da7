"""call counts on rollouts, output sizes on calls, items on grades, run statistics index

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("calls", sa.Integer(), server_default="0", nullable=False))
    with op.batch_alter_table("tool_calls") as batch:
        batch.add_column(sa.Column("output_bytes", sa.Integer(), server_default="0", nullable=False))
    with op.batch_alter_table("grades") as batch:
        batch.add_column(
            sa.Column(
                "item",
                sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
                nullable=True,
            )
        )
    # Backfill what earlier calls would have recorded.
    size = "octet_length(output)" if postgres else "length(CAST(output AS BLOB))"
    op.execute(f"UPDATE tool_calls SET output_bytes = COALESCE({size}, 0) WHERE output IS NOT NULL")
    op.execute(
        "UPDATE rollouts SET calls = "
        "(SELECT count(*) FROM tool_calls WHERE tool_calls.trace_id = rollouts.trace_id)"
    )
    op.create_index(
        "ix_tool_calls_run_tool_latency",
        "tool_calls",
        ["run", "tool", "latency_ms"],
        postgresql_include=["outcome", "output_bytes"],
    )


def downgrade() -> None:
    op.drop_index("ix_tool_calls_run_tool_latency", table_name="tool_calls")
    with op.batch_alter_table("grades") as batch:
        batch.drop_column("item")
    with op.batch_alter_table("tool_calls") as batch:
        batch.drop_column("output_bytes")
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_column("calls")
