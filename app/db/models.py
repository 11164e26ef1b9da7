"""ORM models: rollouts, the log of every tool call, and grades."""

from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import Float, FromClause, Index, Integer, String, Text
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Mapped, mapped_column

from app.db.base import Base, BigIntId, JsonColumn, UtcDateTime
from sparring.wire import ANSWERED_OUTCOMES as ANSWERED_OUTCOMES
from sparring.wire import REPLAYED as REPLAYED

# Outcomes of an attempt that answered its call: it ran (ok, model_error: ANSWERED_OUTCOMES), or the
# ledger replayed the answer an earlier attempt stored (REPLAYED). Which of them is *the* answer is read
# by app/db/call_log.py.
# How a call arrived: the tool routes (rft: training), or the MCP server (mcp: production, local agents).
CHANNELS = ("rft", "mcp", "user")
WORKER_MAX = 128  # tool_calls.worker, remote_rollouts.worker: a worker's name (app.lifespan.worker_name)


class RolloutRow(Base):
    """A rollout's stored row (the client's running rollout is `sparring.client.Rollout`)."""

    __tablename__ = "rollouts"

    trace_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    run: Mapped[str | None] = mapped_column(String(200), index=True)
    item_key: Mapped[str | None] = mapped_column(String(128), index=True)
    first_seen: Mapped[datetime] = mapped_column(UtcDateTime())
    last_seen: Mapped[datetime] = mapped_column(UtcDateTime(), index=True)
    graded_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    # How the rollout's first logged call arrived: rft (the tool routes) or mcp (the MCP server).
    channel: Mapped[str | None] = mapped_column(String(16), index=True)
    # Calls of the rollout as read (app/db/call_log.py), counted by the log writer as it logs them.
    calls: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class ToolCall(Base):
    """One attempt of a tool call: every attempt has its own row (a retry, a replay, a failure).

    What a rollout's call answered is read from its attempts by one rule (app/db/call_log.py).
    """

    __tablename__ = "tool_calls"
    __table_args__ = (
        # A rollout's attempts (by its prefix), and one call's attempts within its rollout's span: which
        # answer stands (app/db/call_log.py), and the writer's count. The only index led by trace_id:
        # beside a (trace_id, started_at) one the planner took that for a call's look-up and read the
        # rollout's every attempt (migration 0010).
        Index("ix_tool_calls_trace_call", "trace_id", "call_id", "started_at"),
        Index("ix_tool_calls_tool_started", "tool", "started_at"),
        # Run statistics (per tool: count, latency percentiles, outcomes, output sizes) read only this;
        # on Postgres it holds started_at too: the span of a run's calls (the partitions to read).
        Index(
            "ix_tool_calls_run_tool_latency",
            "run",
            "tool",
            "latency_ms",
            postgresql_include=["outcome", "output_bytes", "started_at"],
        ),
    )

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    # Named by the server when the attempt starts, so the attempt can be corrected (voided) by it.
    attempt_id: Mapped[str] = mapped_column(String(32), default=lambda: uuid.uuid4().hex)
    trace_id: Mapped[str] = mapped_column(String(128))
    call_id: Mapped[str | None] = mapped_column(String(200))
    request_id: Mapped[str | None] = mapped_column(String(200))
    tool: Mapped[str] = mapped_column(String(128))
    arguments: Mapped[str] = mapped_column(Text)
    output: Mapped[str | None] = mapped_column(Text)
    output_bytes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # UTF-8 length
    outcome: Mapped[str] = mapped_column(String(16), index=True)
    error: Mapped[str | None] = mapped_column(Text)
    status_code: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UtcDateTime())
    ended_at: Mapped[datetime] = mapped_column(UtcDateTime())
    latency_ms: Mapped[float] = mapped_column(Float)
    worker: Mapped[str] = mapped_column(String(WORKER_MAX))
    run: Mapped[str | None] = mapped_column(String(200))
    item_key: Mapped[str | None] = mapped_column(String(128))
    channel: Mapped[str] = mapped_column(String(16), default="rft", server_default="rft")


class Grade(Base):
    __tablename__ = "grades"
    __table_args__ = (Index("ix_grades_trace_created", "trace_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    trace_id: Mapped[str | None] = mapped_column(String(128))
    grader: Mapped[str] = mapped_column(String(128), index=True)
    grader_version: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))  # ok | failed
    score: Mapped[float | None] = mapped_column(Float)
    sub_scores: Mapped[dict[str, Any]] = mapped_column(JsonColumn, default=dict)
    flags: Mapped[list[Any]] = mapped_column(JsonColumn, default=list)
    errors: Mapped[list[Any]] = mapped_column(JsonColumn, default=list)
    sample: Mapped[dict[str, Any]] = mapped_column(JsonColumn, default=dict)
    item: Mapped[dict[str, Any] | None] = mapped_column(JsonColumn, nullable=True)  # to regrade later
    # Hash of the normalized final answer: the same answer across different items is a review flag.
    answer_hash: Mapped[str | None] = mapped_column(String(64), index=True)
    item_key: Mapped[str | None] = mapped_column(String(128))
    run: Mapped[str | None] = mapped_column(String(200))
    latency_ms: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())


class KeptState(Base):
    """A rollout's final state kept durably: its changes against the packs' base data, not a copy.

    Written when the rollout is graded (and when a rollout this server ran ends) while the state store
    still holds it, so a grader that reads state can score the rollout again after the store let it go.
    """

    __tablename__ = "kept_states"

    trace_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    # {pack: {collection: {key: record or None (deleted)}}}: what the rollout changed, as the store holds it.
    changes: Mapped[dict[str, Any]] = mapped_column(JsonColumn, default=dict)
    kept_at: Mapped[datetime] = mapped_column(UtcDateTime())


class RolloutLabel(Base):
    """A person's judgment of a rollout: pass or fail, with an optional note (one label per rollout)."""

    __tablename__ = "rollout_labels"

    trace_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    label: Mapped[str] = mapped_column(String(8), index=True)  # pass | fail
    note: Mapped[str | None] = mapped_column(Text)
    # Who labelled it: "session" (a signed-in reviewer) or "admin" (an admin key).
    labelled_by: Mapped[str] = mapped_column(String(32))
    labelled_at: Mapped[datetime] = mapped_column(UtcDateTime())


class TranscriptRow(Base):
    """A rollout's conversation (`sparring.conversation`): stored by sparring's own loop or by a trainer."""

    __tablename__ = "transcripts"

    trace_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str | None] = mapped_column(String(200))
    source: Mapped[str | None] = mapped_column(String(200))
    # The messages in the stored shape: role, content, reasoning, tool_calls (call_id, name, arguments).
    messages: Mapped[list[Any]] = mapped_column(JsonColumn, default=list)
    size_bytes: Mapped[int] = mapped_column(Integer, default=0)
    stored_at: Mapped[datetime] = mapped_column(UtcDateTime())


class RevokedReviewSession(Base):
    """A review login token ended by logout: refused until it would have expired, then deleted."""

    __tablename__ = "revoked_review_sessions"

    nonce: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime(), index=True)


class RemoteRollout(Base):
    """A rollout a trainer asked this server to run (`POST /remote/init`), with its outcome.

    Kept in the database, not in a worker's memory: the worker running it renews `lease_until`, so a
    rollout whose worker died or restarted is found out and reported as an error, never as finished.
    """

    __tablename__ = "remote_rollouts"
    __table_args__ = (Index("ix_remote_rollouts_status_lease", "status", "lease_until"),)

    rollout_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    # The trace of the current attempt: eval-protocol retries a failed rollout under the same rollout
    # id, and each retry runs as a new attempt (1, 2, ...) with a trace (and so a state) of its own.
    trace_id: Mapped[str] = mapped_column(String(128), index=True)
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    # The attempts before the current one, oldest first: attempt, trace_id, state, reason, status code,
    # created_at, finished_at.
    earlier: Mapped[list[dict[str, Any]]] = mapped_column(JsonColumn, default=list)
    run: Mapped[str | None] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))  # running | finished | error
    reason: Mapped[str | None] = mapped_column(Text)
    reward: Mapped[float | None] = mapped_column(Float)
    grader: Mapped[str | None] = mapped_column(String(128))
    # What the rollout did: turns, tool calls, tokens, the final answer (small; the calls are in the log).
    summary: Mapped[dict[str, Any]] = mapped_column(JsonColumn, default=dict)
    # The init request without its API key (metadata, completion parameters, messages, tools, item).
    request: Mapped[dict[str, Any]] = mapped_column(JsonColumn, default=dict)
    worker: Mapped[str] = mapped_column(String(WORKER_MAX))
    lease_until: Mapped[datetime] = mapped_column(UtcDateTime())
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime())


def postgres_columns(table: FromClause, *, without: tuple[str, ...] = ()) -> tuple[tuple[str, str], ...]:
    """(name, Postgres type) of a table's columns, in table order, without lengths (a length would make
    a cast truncate what the insert must refuse)."""
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    return tuple(
        (column.name, re.sub(r"\(\d+\)", "", column.type.compile(dialect=dialect)).lower())
        for column in table.columns
        if column.name not in without
    )


# What the call-log writer's batch statement reads from JSON (json_to_recordset), from the tables: a
# logged call fills every column but its id; a rollout's row gets all but its grading time and its count.
LOGGED_CALL_COLUMNS = postgres_columns(ToolCall.__table__, without=("id",))
LOGGED_ROLLOUT_COLUMNS = postgres_columns(RolloutRow.__table__, without=("graded_at", "calls"))
