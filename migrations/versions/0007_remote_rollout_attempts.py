"""remote rollout attempts: a failed rollout's retry (the same rollout id) runs as a new attempt

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05

eval-protocol retries a rollout that failed with a new init under the same rollout id. The row of a
remote rollout is now its current attempt (`attempt`, and that attempt's `trace_id`), with the
attempts before it kept in `earlier`. The rows already there are first attempts with none before.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine[object]:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("remote_rollouts") as batch:
        batch.add_column(sa.Column("attempt", sa.Integer(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("earlier", _json(), nullable=False, server_default=sa.text("'[]'")))


def downgrade() -> None:
    # The current attempt stays as the rollout's row; the earlier attempts' records go (their calls
    # stay in the call log under their own trace ids).
    with op.batch_alter_table("remote_rollouts") as batch:
        batch.drop_column("earlier")
        batch.drop_column("attempt")
