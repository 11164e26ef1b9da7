"""Running Alembic migrations from code, and checking that the schema is current."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class SchemaOutOfDate(RuntimeError):
    pass


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def check_schema(engine: AsyncEngine) -> None:
    """Refuse to serve on a schema that is not at the latest migration."""
    async with engine.connect() as conn:
        current = await conn.run_sync(_current)
    head = head_revision()
    if current is None:
        raise SchemaOutOfDate(
            "the database was never migrated (it has no sparring tables); run `sparring db upgrade` "
            "(make run does it for you)"
        )
    if current != head:
        raise SchemaOutOfDate(
            f"database schema is at revision {current or 'none'} but this version needs {head}; "
            "run `sparring db upgrade` (make run does it for you)"
        )
