"""The queries of the review's login sessions: revoked tokens (logged out before they expired)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.db.models import RevokedReviewSession


class RevokedSessions:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def revoke(self, nonce: str, *, expires_at: datetime, now: datetime) -> None:
        """Refuse the token with this nonce until it expires; forget tokens that expired already."""
        await self.session.execute(delete(RevokedReviewSession).where(RevokedReviewSession.expires_at <= now))
        if await self.session.get(RevokedReviewSession, nonce) is None:
            self.session.add(RevokedReviewSession(nonce=nonce, expires_at=expires_at))

    async def is_revoked(self, nonce: str) -> bool:
        found = await self.session.scalar(
            select(RevokedReviewSession.nonce).where(RevokedReviewSession.nonce == nonce)
        )
        return found is not None
