"""What every `sparring` command shares: settings that fail with a readable message, exits, and the
database of the commands that read it, checked before they start."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import typer

from app.config import Settings, get_settings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print `error: message` to stderr and return the Exit to raise (2: usage or config, 1: failure)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def load_settings() -> Settings:
    try:
        return get_settings()
    except Exception as exc:  # pydantic's message names the bad setting
        raise fail(f"invalid settings: {exc}") from exc


async def checked_engine(settings: Settings, *, pool_size: int = 2) -> AsyncEngine:
    """An engine on the configured database, once the database is known to be there, reachable and at
    the schema this version needs; otherwise what is wrong and what to run, as a failed exit."""
    from app.db.migrate import SchemaOutOfDate, check_schema, unreachable_database
    from app.db.session import build_engine
    from app.errors import OUTAGES

    if settings.is_embedded_db and not settings.database_url and not (settings.home / "sparring.db").exists():
        raise fail(
            f"no database at {settings.home / 'sparring.db'}; run `sparring db upgrade` to create it "
            "(or serve with `sparring serve --migrate`)"
        )
    engine = build_engine(settings.effective_database_url, pool_size=pool_size)
    try:
        await check_schema(engine)
    except SchemaOutOfDate as exc:
        await engine.dispose()
        raise fail(str(exc)) from exc
    except OUTAGES as exc:
        await engine.dispose()
        raise fail(unreachable_database(settings.effective_database_url, exc), 1) from exc
    return engine


@asynccontextmanager
async def migrated_database(settings: Settings, *, pool_size: int = 2) -> AsyncIterator[AsyncEngine]:
    """`checked_engine` for the length of a command; a database failing under it is a failed exit,
    not a traceback."""
    from app.errors import OUTAGES

    engine = await checked_engine(settings, pool_size=pool_size)
    try:
        yield engine
    except OUTAGES as exc:
        raise fail(f"the database failed: {type(exc).__name__}: {exc}", 1) from exc
    finally:
        await engine.dispose()
