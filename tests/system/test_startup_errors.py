"""`sparring serve` as a user starts it, with what goes wrong first: a start-up error is a line or two
naming the setting and the fix, with a non-zero exit; the traceback only with `--debug`."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.packs import available_packs
from tests.conftest import API_KEYS, create_pg_database, drop_pg_database, pg_url
from tests.system.helpers import clean_env

SPARRING = str(Path(sys.executable).with_name("sparring"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve(home: Path, *args: str, **settings: str) -> subprocess.CompletedProcess[str]:
    env = clean_env(
        SPARRING_HOME=str(home), SPARRING_PORT=str(free_port()), SPARRING_API_KEYS=API_KEYS, **settings
    )
    return subprocess.run(
        [SPARRING, "serve", *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def errors(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines that report the failure: `error: ...` and uvicorn's ERROR lines."""
    lines = (done.stdout + done.stderr).splitlines()
    return [line for line in lines if line.startswith(("error:", "ERROR:"))]


def assert_brief(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Traceback" not in output, output
    reported = errors(done)
    assert 1 <= len(reported) <= 2, output
    for needle in needles:
        assert needle in reported[0], reported
    return reported[0]


@pytest.fixture
async def empty_database() -> AsyncIterator[str]:
    name = f"sparring_unmigrated_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = await create_pg_database(name)
    yield url
    await drop_pg_database(name)


async def test_an_unmigrated_database_says_to_migrate_and_debug_shows_the_traceback(
    empty_database: str, tmp_path: Path
) -> None:
    done = await asyncio.to_thread(serve, tmp_path, SPARRING_DATABASE_URL=empty_database)
    assert_brief(done, "never migrated", "sparring db upgrade", "--migrate")
    assert done.returncode == 2
    debug = await asyncio.to_thread(serve, tmp_path, "--debug", SPARRING_DATABASE_URL=empty_database)
    assert debug.returncode != 0
    assert "Traceback" in debug.stdout + debug.stderr and "SchemaOutOfDate" in debug.stdout + debug.stderr


async def test_an_unreachable_database_names_the_setting_without_the_password(tmp_path: Path) -> None:
    url = pg_url("nothing").replace("postgres@", "postgres:s3cret@").rsplit(":", 1)[0]
    url = f"{url}:{free_port()}/nothing"  # a port nothing listens on
    done = await asyncio.to_thread(serve, tmp_path, SPARRING_DATABASE_URL=url)
    line = assert_brief(done, "cannot reach the database", "SPARRING_DATABASE_URL", "ConnectionRefusedError")
    assert done.returncode == 1
    assert "s3cret" not in done.stdout + done.stderr and "***" in line


async def test_a_bad_graders_file_names_the_setting_and_the_line(tmp_path: Path) -> None:
    graders = tmp_path / "graders.yaml"
    graders.write_text("exact:\n  type: string_check\n  input: [unclosed\n", encoding="utf-8")
    done = await asyncio.to_thread(serve, tmp_path, "--migrate", SPARRING_GRADERS_FILE=str(graders))
    assert_brief(done, "SPARRING_GRADERS_FILE", str(graders), "not valid YAML", "line ")
    assert done.returncode == 2


async def test_a_wrong_pack_name_lists_the_packs(tmp_path: Path) -> None:
    done = await asyncio.to_thread(serve, tmp_path, "--migrate", SPARRING_PACKS="retial")
    assert_brief(done, "no pack named 'retial'", "SPARRING_PACKS", ", ".join(available_packs()))


async def test_a_pack_that_cannot_start_fails_in_one_line_from_the_server_itself(tmp_path: Path) -> None:
    """A failure only the server's start-up meets (the pack's data): its one line, no traceback."""
    done = await asyncio.to_thread(
        serve,
        tmp_path,
        "--migrate",
        SPARRING_PACKS="retail",
        SPARRING_RETAIL_DATA=str(tmp_path / "no-such-dir"),
    )
    line = assert_brief(done, "pack 'retail' cannot start", "--debug")
    assert line.startswith("ERROR:")
