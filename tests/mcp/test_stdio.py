"""`sparring mcp` over stdio, driven by the official client: the same tools, logged the same way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from tests.conftest import REDIS_KEY_PREFIX, REDIS_URL, new_trace
from tests.mcp.conftest import text_of
from tests.system.helpers import ROOT, clean_env

SPARRING = str(Path(sys.executable).with_name("sparring"))


async def logged(database_url: str) -> list[dict[str, Any]]:
    engine = create_async_engine(database_url, poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            result = await conn.execute(
                text(
                    "SELECT c.trace_id, c.run, c.channel, c.tool, c.outcome, c.output, "
                    "r.channel AS rollout_channel FROM tool_calls c "
                    "JOIN rollouts r ON r.trace_id = c.trace_id ORDER BY c.id"
                )
            )
            return [dict(row._mapping) for row in result]
    finally:
        await engine.dispose()


async def test_stdio_on_the_embedded_default(tmp_path: Path) -> None:
    env = clean_env(SPARRING_HOME=str(tmp_path / "home"))
    params = StdioServerParameters(command=SPARRING, args=["mcp"], env=env, cwd=str(ROOT))
    async with Client(params) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        added = await client.call_tool("add_note", {"title": "first", "body": "a note"})
        listed = await client.call_tool("list_notes", {})
        again = await client.call_tool("add_note", {"title": "first", "body": "twice"})
        wrong = await client.call_tool("echo", {"txt": "hi"})

    assert set(tools) == {"echo", "add_note", "list_notes"}
    assert tools["add_note"].annotations and tools["add_note"].annotations.destructive_hint is True
    assert text_of(added) == '{"number":1,"title":"first","body":"a note"}' and not added.is_error
    assert text_of(listed) == '[{"number":1,"title":"first","body":"a note"}]'
    assert again.is_error and text_of(again).startswith("Error: ")
    assert wrong.is_error and "text: required field is missing" in text_of(wrong)

    rows = await logged(f"sqlite+aiosqlite:///{tmp_path / 'home' / 'sparring.db'}")
    assert [(r["tool"], r["outcome"]) for r in rows] == [
        ("add_note", "ok"),
        ("list_notes", "ok"),
        ("add_note", "model_error"),
        ("echo", "model_error"),
    ]
    assert {(r["run"], r["channel"], r["rollout_channel"]) for r in rows} == {("local", "mcp", "mcp")}
    [trace] = {r["trace_id"] for r in rows}
    assert trace.startswith("trace_mcp_")
    assert rows[1]["output"] == text_of(listed)


async def test_stdio_on_postgres_and_redis_with_a_named_rollout(pg_database: str, tmp_path: Path) -> None:
    trace = new_trace()
    env = clean_env(
        SPARRING_HOME=str(tmp_path / "home"),
        SPARRING_DATABASE_URL=pg_database,
        SPARRING_REDIS_URL=REDIS_URL,
        SPARRING_REDIS_KEY_PREFIX=REDIS_KEY_PREFIX,
    )
    args = ["mcp", "--trace-id", trace, "--run", "desk"]
    async with Client(StdioServerParameters(command=SPARRING, args=args, env=env, cwd=str(ROOT))) as client:
        await client.call_tool("add_note", {"title": "kept", "body": None})
    # The rollout's state is in Redis: a second process (a restarted desktop client) sees it.
    async with Client(StdioServerParameters(command=SPARRING, args=args, env=env, cwd=str(ROOT))) as client:
        listed = await client.call_tool("list_notes", {})
    assert text_of(listed) == '[{"number":1,"title":"kept","body":""}]'
    rows = [r for r in await logged(pg_database) if r["trace_id"] == trace]
    assert [(r["tool"], r["run"], r["channel"]) for r in rows] == [
        ("add_note", "desk", "mcp"),
        ("list_notes", "desk", "mcp"),
    ]


async def test_stdio_serves_one_packs_tools_with_pack(tmp_path: Path) -> None:
    env = clean_env(SPARRING_HOME=str(tmp_path / "home"), SPARRING_PACKS="demo,retail")
    params = StdioServerParameters(command=SPARRING, args=["mcp", "--pack", "demo"], env=env, cwd=str(ROOT))
    async with Client(params) as client:
        tools = {t.name for t in (await client.list_tools()).tools}
        other = await client.call_tool("get_user_details", {"user_id": "x"})
    assert tools == {"echo", "add_note", "list_notes"}
    assert other.is_error and text_of(other).startswith("Error: ")


def test_stdio_names_the_enabled_packs_for_a_wrong_pack(tmp_path: Path) -> None:
    env = clean_env(SPARRING_HOME=str(tmp_path / "home"), SPARRING_PACKS="demo,retail")
    wrong = subprocess.run(
        [SPARRING, "mcp", "--pack", "nope"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert wrong.returncode == 2 and "demo, retail" in wrong.stderr
