"""The review UI's login session: an HMAC-signed, expiring token in an HttpOnly cookie (never the key).

The signing secret is derived from the configured admin keys, so every worker and replica verifies
the same tokens, and changing the admin keys ends every session. Logout revokes its token in the
database (every worker reads the same revocations) until the token would have expired.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from datetime import UTC, datetime
from urllib.parse import urlencode

from fastapi import Request, Response

from app.auth import KeyRing
from app.deps import app_state, database
from app.errors import Forbidden, SparringError, Unauthorized
from app.review.session_repository import RevokedSessions

COOKIE_NAME = "sparring_review"
SESSION_SECONDS = 12 * 3600
_CONTEXT = b"sparring review session v1\x00"


class LoginRequired(SparringError):
    """A review page opened without a login: 303 to the login page, which comes back here after."""

    status_code = 303
    code = "login_required"

    def __init__(self, target: str) -> None:
        super().__init__("log in to the review first")
        self.target = target

    def headers(self) -> dict[str, str]:
        return {"Location": f"/review/login?{urlencode({'next': self.target})}"}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _signing_key(keyring: KeyRing) -> bytes | None:
    admin = sorted(k.secret.get_secret_value() for k in keyring.keys if k.scope == "admin")
    if not admin:
        return None
    return hashlib.sha256(_CONTEXT + "\x00".join(admin).encode()).digest()


def _mac(key: bytes, payload: str) -> str:
    return _b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())


def issue_token(keyring: KeyRing, *, now: float | None = None, ttl: int = SESSION_SECONDS) -> str:
    key = _signing_key(keyring)
    if key is None:
        raise Unauthorized("no admin key is configured: the review cannot be opened")
    payload = f"{int((now or time.time()) + ttl)}.{secrets.token_urlsafe(12)}"
    return f"{payload}.{_mac(key, payload)}"


def verify_token(keyring: KeyRing, token: str, *, now: float | None = None) -> bool:
    return _verified(keyring, token, now=now) is not None


def _verified(keyring: KeyRing, token: str, *, now: float | None = None) -> tuple[str, int] | None:
    """The token's nonce and expiry when its signature holds and it has not expired."""
    key = _signing_key(keyring)
    expires, _, rest = token.partition(".")
    nonce, _, mac = rest.partition(".")
    # A header arrives as Latin-1: a forged token may hold any byte (compare_digest takes ASCII only).
    if key is None or not token.isascii() or not (expires.isdigit() and nonce and mac) or len(nonce) > 64:
        return None
    if not hmac.compare_digest(mac, _mac(key, f"{expires}.{nonce}")):
        return None
    return (nonce, int(expires)) if int(expires) > (now or time.time()) else None


def require_same_origin(request: Request) -> None:
    """Refuse a cross-site POST (login CSRF, forced logout): 403.

    SameSite=Strict keeps the cookie off cross-site requests, but a cross-site form could still log a
    browser in with the attacker's key or log it out. Browsers name the page that sent a POST in
    `Origin` (and `Sec-Fetch-Site`); a request without them is not a browser's and carries no cookie
    the attacker controls.
    """
    refused = Forbidden("the review login and logout accept requests from the review's own pages only")
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        # Browsers that send it say where the request came from even when `Origin` is "null" (the
        # pages' no-referrer policy makes a same-origin form POST send `Origin: null`).
        if site not in ("same-origin", "none"):
            raise refused
        return
    origin = request.headers.get("origin")
    if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
        raise refused


def is_admin_key(keyring: KeyRing, presented: str) -> bool:
    return "admin" in keyring.scopes_of(presented)


async def has_session(request: Request) -> bool:
    """A signed, unexpired login token that was not logged out (revocations are in the database)."""
    token = request.cookies.get(COOKIE_NAME)
    state = app_state(request.app)
    verified = _verified(state.keyring, token) if token else None
    if verified is None:
        return False
    async with database(request.app).session() as session:
        return not await RevokedSessions(session).is_revoked(verified[0])


def start_session(request: Request, response: Response) -> None:
    response.set_cookie(
        COOKIE_NAME,
        issue_token(app_state(request.app).keyring),
        max_age=SESSION_SECONDS,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


async def end_session(request: Request, response: Response) -> None:
    """Delete the cookie, and revoke its token on the server so that no copy of it opens the review."""
    token = request.cookies.get(COOKIE_NAME)
    state = app_state(request.app)
    verified = _verified(state.keyring, token) if token else None
    if verified is not None:
        nonce, expires = verified
        async with database(request.app).session(write=True) as session:
            await RevokedSessions(session).revoke(
                nonce, expires_at=datetime.fromtimestamp(expires, UTC), now=datetime.now(UTC)
            )
    response.delete_cookie(
        COOKIE_NAME, path="/", httponly=True, samesite="strict", secure=request.url.scheme == "https"
    )


async def require_login(request: Request) -> None:
    """Raise LoginRequired unless the browser holds a review login."""
    if not await has_session(request):
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(target)


async def require_review_access(request: Request) -> str:
    """The review API and the export: a logged-in browser session, or an admin key in the header."""
    if await has_session(request):
        return "session"
    app_state(request.app).keyring.authorize(request, "admin")
    return "admin"
