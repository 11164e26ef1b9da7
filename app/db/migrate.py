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


def unreachable_database(database_url: str, exc: BaseException) -> str:
    """Why the database at `database_url` cannot be used at start-up, naming the setting and the fix
    (the URL shown without its password)."""
    from sqlalchemy.engine import make_url

    try:
        shown = make_url(database_url).render_as_string(hide_password=True)
    except Exception:  # a URL SQLAlchemy cannot parse is shown as nothing rather than leaked
        shown = "(unparsable)"
    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    return (
        f"cannot reach the database {shown} ({reason}); start it, or point SPARRING_DATABASE_URL at "
        "one that runs (unset: the embedded SQLite database)"
    )


async def check_schema(engine: AsyncEngine) -> None:
    """Refuse to serve on a schema that is not at the latest migration."""
    async with engine.connect() as conn:
        current = await conn.run_sync(_current)
    head = head_revision()
    if current is None:
        raise SchemaOutOfDate(
            "the database was never migrated (it has no sparring tables); run `sparring db upgrade` "
            "(or serve with `sparring serve --migrate`, as make run does)"
        )
    if current != head:
        raise SchemaOutOfDate(
            f"database schema is at revision {current or 'none'} but this version needs {head}; "
            "run `sparring db upgrade` (or serve with `sparring serve --migrate`, as make run does)"
        )
