"""The review's database boundary: one read session per request, outages answered 503 + Retry-After."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.errors import ServiceUnavailable


class ReviewUnavailable(ServiceUnavailable):
    code = "review_unavailable"


class ReviewDatabase:
    """Opens sessions for the review routes and turns database failures into 503s."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], retry_after: int) -> None:
        self.sessions = sessions
        self.retry_after = retry_after

    def unavailable(self, exc: BaseException) -> ReviewUnavailable:
        return ReviewUnavailable(f"database unreachable: {type(exc).__name__}", retry_after=self.retry_after)

    @asynccontextmanager
    async def session(self, *, write: bool = False) -> AsyncIterator[AsyncSession]:
        try:
            async with self.sessions() as session:
                if write:
                    async with session.begin():
                        yield session
                else:
                    yield session
        except (SQLAlchemyError, OSError) as exc:
            raise self.unavailable(exc) from exc


async def get_review_database(request: Request) -> ReviewDatabase:
    return ReviewDatabase(request.app.state.sessionmaker, request.app.state.settings.retry_after_seconds)


ReviewDb = Annotated[ReviewDatabase, Depends(get_review_database)]
