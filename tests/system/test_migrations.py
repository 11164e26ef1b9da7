"""Migrations up, down and up on SQLite and Postgres; models agree with them; stale schemas are refused."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, inspect
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from app.db.migrate import downgrade, head_revision, upgrade
from app.db.models import Base
from app.db.partitions import include_name, is_partition_name
from tests.conftest import REDIS_URL, create_pg_database, drop_pg_database
from tests.system.helpers import ROOT, Servers, clean_env, server_settings

TABLES = {
    "rollouts",
    "tool_calls",
    "grades",
    "revoked_review_sessions",
    "remote_rollouts",
    "kept_states",
    "rollout_labels",
    "transcripts",
}


@pytest.fixture(params=["sqlite", "postgres"])
async def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A database with no schema at all."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'sparring.db'}"
        return
    name = f"sparring_sys_migrate_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = await create_pg_database(name)
    try:
        yield url
    finally:
        await drop_pg_database(name)


def _schema(connection: Connection) -> dict[str, Any]:
    """Tables with their columns, primary key, indexes and the Alembic revision."""
    inspector = inspect(connection)
    schema: dict[str, Any] = {}
    for table in sorted(inspector.get_table_names()):
        if is_partition_name(table):  # the call log's partitions (Postgres): made at run time
            continue
        schema[table] = {
            "columns": [(c["name"], str(c["type"]), c["nullable"]) for c in inspector.get_columns(table)],
            "pk": inspector.get_pk_constraint(table),
            "indexes": sorted(
                (i["name"] or "", tuple(i["column_names"]), bool(i["unique"]))
                for i in inspector.get_indexes(table)
            ),
        }
    schema["revision"] = MigrationContext.configure(connection).get_current_revision()
    return schema


def _diff(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(
        connection,
        opts={"compare_type": True, "target_metadata": Base.metadata, "include_name": include_name},
    )
    return list(compare_metadata(context, Base.metadata))


async def inspect_db(url: str, fn: Any) -> Any:
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(fn)
    finally:
        await engine.dispose()


async def test_migrations_up_down_up(empty_database: str) -> None:
    await asyncio.to_thread(upgrade, empty_database)
    first = await inspect_db(empty_database, _schema)
    assert first["revision"] == head_revision()
    assert set(first) - {"revision", "alembic_version"} == TABLES
    indexes = {i[0] for i in first["tool_calls"]["indexes"]}
    assert "ix_tool_calls_trace_call" in indexes and "ix_tool_calls_trace_started" not in indexes
    assert "uq_tool_calls_answered" not in indexes  # 0006: every attempt its own row

    await asyncio.to_thread(downgrade, empty_database, "base")
    emptied = await inspect_db(empty_database, _schema)
    assert emptied["revision"] is None
    assert not (set(emptied) & TABLES), "downgrade to base left tables behind"

    await asyncio.to_thread(upgrade, empty_database)
    assert await inspect_db(empty_database, _schema) == first
    # Upgrading an up-to-date database changes nothing.
    await asyncio.to_thread(upgrade, empty_database)
    assert await inspect_db(empty_database, _schema) == first


async def test_models_and_migrations_agree(empty_database: str) -> None:
    await asyncio.to_thread(upgrade, empty_database)
    assert await inspect_db(empty_database, _diff) == []


def _sparring(*args: str, settings: dict[str, str]) -> subprocess.CompletedProcess[str]:
    sparring = Path(sys.executable).with_name("sparring")
    return subprocess.run(
        [str(sparring), *args],
        cwd=ROOT,
        env=clean_env(**settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
async def test_server_refuses_an_out_of_date_schema(
    empty_database: str, servers: Servers, tmp_path: Path
) -> None:
    settings = server_settings(
        database_url=empty_database,
        redis_url=REDIS_URL if "postgresql" in empty_database else None,
        home=tmp_path / "home",
        worker="stale",
    )
    # No schema at all: `sparring serve` exits with a message naming the command that fixes it.
    refused = servers.launch("stale", settings, cli=True)
    code = await refused.wait_exit(60)
    assert code != 0
    assert "sparring db upgrade" in refused.output, refused.output

    # After the command it names, the same settings serve.
    done = _sparring("db", "upgrade", settings=settings)
    assert done.returncode == 0, done.stdout + done.stderr
    server = await servers.start("current", settings, cli=True)
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(f"{server.url}/readyz")).status_code == 200


async def test_0002_backfills_call_counts_and_output_sizes(empty_database: str) -> None:
    """Rows logged under 0001 get their rollout's call count and each output's UTF-8 size."""
    from sqlalchemy import text

    await asyncio.to_thread(upgrade, empty_database, "0001")
    engine = create_async_engine(empty_database, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO rollouts (trace_id, first_seen, last_seen) VALUES "
                    "('t1', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP), "
                    "('t2', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            for i, output in enumerate(["héllo", None, "ok"]):
                await conn.execute(
                    text(
                        "INSERT INTO tool_calls (trace_id, call_id, tool, arguments, output, outcome, "
                        "status_code, started_at, ended_at, latency_ms, worker) VALUES "
                        "('t1', :call, 'echo', '{}', :output, 'ok', 200, CURRENT_TIMESTAMP, "
                        "CURRENT_TIMESTAMP, 1.0, 'w')"
                    ),
                    {"call": f"c{i}", "output": output},
                )
        await asyncio.to_thread(upgrade, empty_database)
        async with engine.connect() as conn:
            counts = dict((await conn.execute(text("SELECT trace_id, calls FROM rollouts"))).all())
            sizes = dict((await conn.execute(text("SELECT call_id, output_bytes FROM tool_calls"))).all())
        assert counts == {"t1": 3, "t2": 0}
        assert sizes == {"c0": 6, "c1": 0, "c2": 2}  # bytes, not characters
        await asyncio.to_thread(downgrade, empty_database, "0001")
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT count(*) FROM tool_calls"))).scalar_one()
        assert rows == 3  # the downgrade keeps the log
    finally:
        await engine.dispose()


async def test_0003_puts_earlier_calls_and_rollouts_on_the_rft_channel(empty_database: str) -> None:
    """Everything logged before channels existed came through the tool routes; a downgrade keeps the log."""
    from sqlalchemy import text

    await asyncio.to_thread(upgrade, empty_database, "0002")
    engine = create_async_engine(empty_database, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO rollouts (trace_id, first_seen, last_seen) VALUES "
                    "('t1', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            await conn.execute(
                text(
                    "INSERT INTO tool_calls (trace_id, call_id, tool, arguments, output, outcome, "
                    "status_code, started_at, ended_at, latency_ms, worker) VALUES "
                    "('t1', 'c1', 'echo', '{}', 'hi', 'ok', 200, CURRENT_TIMESTAMP, "
                    "CURRENT_TIMESTAMP, 1.0, 'w')"
                )
            )
        await asyncio.to_thread(upgrade, empty_database, "0003")
        async with engine.connect() as conn:
            rollouts = (await conn.execute(text("SELECT trace_id, channel FROM rollouts"))).all()
            calls = (await conn.execute(text("SELECT call_id, channel FROM tool_calls"))).all()
        assert [tuple(r) for r in rollouts] == [("t1", "rft")]
        assert [tuple(c) for c in calls] == [("c1", "rft")]
        await asyncio.to_thread(downgrade, empty_database, "0002")
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM tool_calls"))).scalar_one() == 1
    finally:
        await engine.dispose()


def _index_definitions(connection: Connection) -> list[str]:
    """The SQL of every index (partial-index predicates and INCLUDE columns included)."""
    if connection.dialect.name == "sqlite":
        query = "SELECT sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
    else:
        query = "SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema()"
    return sorted(str(row[0]) for row in connection.exec_driver_sql(query))


def _full_schema(connection: Connection) -> dict[str, Any]:
    return {**_schema(connection), "index_sql": _index_definitions(connection)}


async def test_0002_down_and_up_again_with_rows(empty_database: str) -> None:
    """0001 → head → 0001 gives back the 0001 schema exactly, rows kept; up again backfills again."""
    from sqlalchemy import text

    await asyncio.to_thread(upgrade, empty_database, "0001")
    at_0001 = await inspect_db(empty_database, _full_schema)
    engine = create_async_engine(empty_database, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO rollouts (trace_id, first_seen, last_seen) "
                    "VALUES ('t1', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
            await conn.execute(
                text(
                    "INSERT INTO grades (trace_id, grader, grader_version, status, score, sub_scores, flags, "
                    "errors, sample, latency_ms, created_at) VALUES ('t1', 'g', '1', 'ok', 1.0, '{}', '[]', "
                    "'[]', '{}', 1.0, CURRENT_TIMESTAMP)"
                )
            )
        await asyncio.to_thread(upgrade, empty_database)
        at_head = await inspect_db(empty_database, _full_schema)
        assert "ix_tool_calls_run_tool_latency" in {i[0] for i in at_head["tool_calls"]["indexes"]}
        async with engine.begin() as conn:
            assert (await conn.execute(text("SELECT item FROM grades"))).scalar_one() is None
            # Calls logged under 0002 with their sizes, then the rollout's count set by the writer.
            for i, output in enumerate(["€", "abc"]):
                await conn.execute(
                    text(
                        "INSERT INTO tool_calls (attempt_id, trace_id, call_id, tool, arguments, output, "
                        "output_bytes, outcome, status_code, started_at, ended_at, latency_ms, worker) "
                        "VALUES (:call, 't1', :call, 'echo', '{}', :output, :size, 'ok', 200, "
                        "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 1.0, 'w')"
                    ),
                    {"call": f"c{i}", "output": output, "size": len(output.encode())},
                )
            await conn.execute(text("UPDATE rollouts SET calls = 2"))

        await asyncio.to_thread(downgrade, empty_database, "0001")
        assert await inspect_db(empty_database, _full_schema) == at_0001
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT count(*) FROM tool_calls"))).scalar_one() == 2
            assert (await conn.execute(text("SELECT count(*) FROM grades"))).scalar_one() == 1
            # The partial unique index still only binds answered calls.
            await conn.execute(
                text(
                    "INSERT INTO tool_calls (trace_id, call_id, tool, arguments, outcome, status_code, "
                    "started_at, ended_at, latency_ms, worker) VALUES ('t1', 'c9', 'echo', '{}', "
                    "'infra_error', 503, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 1.0, 'w'), ('t1', 'c9', "
                    "'echo', '{}', 'infra_error', 503, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 1.0, 'w')"
                )
            )
            await conn.commit()

        await asyncio.to_thread(upgrade, empty_database)
        assert await inspect_db(empty_database, _full_schema) == at_head
        async with engine.connect() as conn:
            counts = (await conn.execute(text("SELECT calls FROM rollouts"))).scalar_one()
            sizes = dict((await conn.execute(text("SELECT call_id, output_bytes FROM tool_calls"))).all())
        assert counts == 4
        assert sizes == {"c0": 3, "c1": 3, "c9": 0}
    finally:
        await engine.dispose()


_CALL_ROW = (
    "INSERT INTO tool_calls (trace_id, call_id, tool, arguments, output, output_bytes, outcome, error, "
    "status_code, started_at, ended_at, latency_ms, worker{extra}) VALUES (:trace, :call, 'echo', '{{}}', "
    ":output, 0, :outcome, :error, :status, :started, :started, 1.0, 'w'{values})"
)


async def test_0006_makes_every_logged_row_an_attempt_and_back(empty_database: str) -> None:
    """Rows logged under 0005 become attempts with ids of their own, read as before; then a call
    answered twice and a replay can be logged; the downgrade keeps one answered row per call."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import select, text

    from app.db.call_log import logged_calls
    from app.db.models import ToolCall

    t0 = datetime(2026, 5, 1, tzinfo=UTC)
    await asyncio.to_thread(upgrade, empty_database, "0005")
    engine = create_async_engine(empty_database, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO rollouts (trace_id, first_seen, last_seen, calls) "
                    "VALUES ('t1', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 3)"
                )
            )
            old = [
                ("c1", None, "infra_error", "lost", 503, t0),
                ("c1", "answer", "ok", None, 200, t0 + timedelta(seconds=1)),
                ("c2", "Error: no", "model_error", "Error: no", 200, t0 + timedelta(seconds=2)),
            ]
            for call, output, outcome, error, status, started in old:
                params = {"trace": "t1", "call": call, "output": output, "outcome": outcome}
                params |= {"error": error, "status": status, "started": started}
                await conn.execute(text(_CALL_ROW.format(extra="", values="")), params)
        await asyncio.to_thread(upgrade, empty_database)
        async with engine.begin() as conn:
            ids = (await conn.execute(text("SELECT attempt_id FROM tool_calls"))).scalars().all()
            assert len(set(ids)) == 3 and all(ids)
            read = (await conn.execute(logged_calls(ToolCall.trace_id == "t1"))).all()
            assert [(r.call_id, r.outcome, r.output) for r in read] == [
                ("c1", "infra_error", None),
                ("c1", "ok", "answer"),  # at the call's first start: after its failure by id
                ("c2", "model_error", "Error: no"),
            ]
            assert read[1].started_at == t0
            # Now a call may have several answering attempts: run again, and replayed.
            for n, (call, output, outcome) in enumerate(
                [("c1", "again", "ok"), ("c2", "Error: no", "replayed"), ("c3", "only a replay", "replayed")]
            ):
                params = {"trace": "t1", "call": call, "output": output, "outcome": outcome, "error": None}
                params |= {"status": 200, "started": t0 + timedelta(seconds=10 + n), "attempt": f"new{n}"}
                await conn.execute(text(_CALL_ROW.format(extra=", attempt_id", values=", :attempt")), params)
            read = (await conn.execute(logged_calls(ToolCall.trace_id == "t1"))).all()
            assert [(r.call_id, r.outcome, r.output) for r in read] == [
                ("c1", "infra_error", None),
                ("c1", "ok", "again"),
                ("c2", "model_error", "Error: no"),
                ("c3", "replayed", "only a replay"),
            ]
        await asyncio.to_thread(downgrade, empty_database, "0005")
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    text("SELECT call_id, outcome, output FROM tool_calls ORDER BY call_id, outcome")
                )
            ).all()
        assert [tuple(r) for r in rows] == [
            ("c1", "infra_error", None),
            ("c1", "ok", "again"),
            ("c2", "model_error", "Error: no"),
            ("c3", "ok", "only a replay"),
        ]
        assert "uq_tool_calls_answered" in {
            i[0] for i in (await inspect_db(empty_database, _schema))["tool_calls"]["indexes"]
        }
        await asyncio.to_thread(upgrade, empty_database)
        async with engine.connect() as conn:
            started = (
                await conn.execute(select(ToolCall.started_at).where(ToolCall.output == "again"))
            ).scalar_one()
        assert started == t0  # the downgrade kept the answer at its call's first start
    finally:
        await engine.dispose()
