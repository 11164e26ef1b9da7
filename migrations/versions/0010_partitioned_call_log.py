"""partitioned call log: tool_calls range-partitioned by started_at (one partition per UTC day), Postgres

Revision ID: 0010_partitioned_call_log
Revises: 0009_transcripts
Create Date: 2026-12-06

On Postgres, `tool_calls` becomes a partitioned table (app/db/partitions.py): a partition for every
day the log holds calls of and for the days ahead, and a DEFAULT partition for a call of a day without
one. The rows move over with their ids (the id sequence stays, so ids go on from where they were).
A primary key of a partitioned table must hold the partition key: it is (id, started_at); ids still
come from one sequence, so they stay unique. The indexes are the same, built once the rows are in,
except that the run index also holds started_at (the span of a run's calls, read from the index:
the run statistics read the partitions of that span only).
On both backends the call index (trace_id, call_id) gains started_at (one call's attempts within a
span) and (trace_id, started_at) goes: the call index serves a rollout's reads by its prefix. The
downgrade moves the rows back into one plain table. SQLite keeps its one table.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from sqlalchemy import text

from app.db.partitions import AHEAD_DAYS, DEFAULT_PARTITION, create_days

revision: str = "0010_partitioned_call_log"
down_revision: str | None = "0009_transcripts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD = "tool_calls_unpartitioned"
# The indexes of 0009, rebuilt on whichever table is `tool_calls` after the move.
_INDEXES = (
    "CREATE INDEX ix_tool_calls_outcome ON tool_calls (outcome)",
    "CREATE INDEX ix_tool_calls_run_tool_latency ON tool_calls (run, tool, latency_ms) INCLUDE ({include})",
    "CREATE INDEX ix_tool_calls_tool_started ON tool_calls (tool, started_at)",
    "CREATE INDEX ix_tool_calls_trace_call ON tool_calls (trace_id, call_id{call_started})",
)
# 0009's index of a rollout's attempts by start, which 0010 drops (the call index serves its reads).
_TRACE_STARTED = "CREATE INDEX ix_tool_calls_trace_started ON tool_calls (trace_id, started_at)"


def _indexes(include: str, call_started: str) -> None:
    for statement in _INDEXES:
        op.execute(statement.format(include=include, call_started=call_started))


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        # The same indexes on both backends (see the Postgres branch's note).
        op.drop_index("ix_tool_calls_trace_started", table_name="tool_calls")
        op.drop_index("ix_tool_calls_trace_call", table_name="tool_calls")
        op.create_index("ix_tool_calls_trace_call", "tool_calls", ["trace_id", "call_id", "started_at"])
        return
    from datetime import UTC, datetime, timedelta

    op.execute(f"ALTER TABLE tool_calls RENAME TO {_OLD}")
    op.execute(f"CREATE TABLE tool_calls (LIKE {_OLD} INCLUDING DEFAULTS) PARTITION BY RANGE (started_at)")
    op.execute(f"CREATE TABLE {DEFAULT_PARTITION} PARTITION OF tool_calls DEFAULT")
    days = set(
        bind.execute(
            text(
                f"SELECT DISTINCT CAST(date_trunc('day', started_at AT TIME ZONE 'UTC') AS date) FROM {_OLD}"
            )
        ).scalars()
    )
    today = datetime.now(UTC).date()
    days.update(today + timedelta(days=n) for n in range(AHEAD_DAYS))
    create_days(bind, days)
    op.execute(f"INSERT INTO tool_calls SELECT * FROM {_OLD}")
    op.execute("ALTER SEQUENCE tool_calls_id_seq OWNED BY tool_calls.id")
    op.execute(f"DROP TABLE {_OLD}")
    op.execute("ALTER TABLE tool_calls ADD CONSTRAINT pk_tool_calls PRIMARY KEY (id, started_at)")
    # The run index holds started_at too: the span of a run's calls, read without the rows. The call
    # index ends with started_at and is the only one led by trace_id: the writer's probe for an
    # earlier answer and the log's rule look up one call's attempts within its rollout's span, an
    # index range of that call only. With (trace_id, started_at) beside it the planner took that one
    # for the probe (equal estimates) and read every attempt of the rollout in the span: a cost per
    # call that grows with the rollout (the log wrote at half the rate with 100-call batches). A
    # rollout's timeline reads the call index by its trace_id prefix.
    _indexes("outcome, output_bytes, started_at", ", started_at")
    op.execute("ANALYZE tool_calls")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        op.drop_index("ix_tool_calls_trace_call", table_name="tool_calls")
        op.create_index("ix_tool_calls_trace_call", "tool_calls", ["trace_id", "call_id"])
        op.create_index("ix_tool_calls_trace_started", "tool_calls", ["trace_id", "started_at"])
        return
    op.execute(f"CREATE TABLE {_OLD} (LIKE tool_calls INCLUDING DEFAULTS)")
    op.execute(f"INSERT INTO {_OLD} SELECT * FROM tool_calls")
    op.execute(f"ALTER SEQUENCE tool_calls_id_seq OWNED BY {_OLD}.id")
    op.execute("DROP TABLE tool_calls")  # with its partitions
    op.execute(f"ALTER TABLE {_OLD} RENAME TO tool_calls")
    op.execute("ALTER TABLE tool_calls ADD CONSTRAINT pk_tool_calls PRIMARY KEY (id)")
    _indexes("outcome, output_bytes", "")
    op.execute(_TRACE_STARTED)
    op.execute("ANALYZE tool_calls")
