"""Engine and session factory construction (called from the lifespan, never at import), and the
`Database` boundary through which routes and services open their sessions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from app.errors import OUTAGES, outage

BUSY_TIMEOUT_MS = 30_000  # how long a SQLite statement waits for another connection's write lock


def build_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": BUSY_TIMEOUT_MS / 1000}
    else:
        kwargs.update(pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True, pool_timeout=10)
    engine = create_async_engine(url, **kwargs)
    if url.startswith("sqlite"):
        event.listen(engine.sync_engine, "connect", sqlite_pragmas)
    return engine


def sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    """Every SQLite connection's settings: WAL lets readers run beside the log writer; FULL syncs each
    (group) commit to disk. And `unicode_lower`, as Postgres' lower() (SQLite's folds ASCII only)."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cursor.close()
    dbapi_connection.create_function(UNICODE_LOWER, 1, _unicode_lower, deterministic=True)


UNICODE_LOWER = "unicode_lower"  # SQLite: lower() of every letter, not of ASCII alone


def _unicode_lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def build_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[Any]:
    return async_sessionmaker(engine, expire_on_commit=False)


class Database:
    """The one outage boundary of the database: sessions whose driver, pool or network failure leaves
    as the 503 (with Retry-After) that answers it, so no route or service translates one itself.

    A caller that must go on through an outage (a background task, a best-effort write) catches
    `ServiceUnavailable`, never the drivers' own errors.
    """

    def __init__(self, sessions: async_sessionmaker[AsyncSession], retry_after: int) -> None:
        self.sessions = sessions
        self.retry_after = retry_after

    @asynccontextmanager
    async def session(self, *, write: bool = False) -> AsyncIterator[AsyncSession]:
        """One session; with `write`, one transaction committed when the block ends."""
        try:
            async with self.sessions() as session:
                if write:
                    async with session.begin():
                        yield session
                else:
                    yield session
        except OUTAGES as exc:
            raise outage(exc, self.retry_after) from exc
