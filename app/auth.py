"""API keys and scopes: every route but the health checks needs a key of the right scope."""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from starlette.requests import HTTPConnection

from app.config import ApiKey, Scope, Settings
from app.errors import Forbidden, Unauthorized

ADMIN_KEY_FILE = "admin.key"


@dataclass(frozen=True)
class KeyRing:
    keys: tuple[ApiKey, ...]
    header: str

    def extract(self, request: HTTPConnection) -> str | None:
        value = request.headers.get(self.header)
        if value is None:
            return None
        if self.header.lower() == "authorization":
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
        return value.strip() or None

    def _missing(self, request: HTTPConnection) -> str:
        """Why no key was read: no header, or an Authorization header without its `Bearer ` scheme."""
        value = request.headers.get(self.header)
        if value is None or self.header.lower() != "authorization":
            return f"missing API key: send it in the {self.header} header"
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and not token.strip():
            return "the Authorization header holds 'Bearer' without a key: send 'Authorization: Bearer <key>'"
        return "the Authorization header must read 'Bearer <key>': the 'Bearer ' before the key is missing"

    def scopes_of(self, presented: str) -> set[Scope]:
        """Compare against every key in constant time (no early exit that leaks which key matched)."""
        found: set[Scope] = set()
        given = presented.encode()
        for secret, scope in self._secrets:
            if hmac.compare_digest(given, secret):
                found.add(scope)
        return found

    @cached_property
    def _secrets(self) -> tuple[tuple[bytes, Scope], ...]:
        return tuple((key.secret.get_secret_value().encode(), key.scope) for key in self.keys)

    def authorize(self, request: HTTPConnection, scope: Scope) -> Scope:
        presented = self.extract(request)
        if presented is None:
            raise Unauthorized(self._missing(request))
        scopes = self.scopes_of(presented)
        if not scopes:
            raise Unauthorized("invalid API key")
        if scope in scopes:
            return scope
        if "admin" in scopes:
            return "admin"
        raise Forbidden(f"this key does not have the {scope!r} scope")


def ensure_local_admin_key(home: Path) -> tuple[str, bool]:
    """The embedded default's admin key: read it from <home>/admin.key, or create it (mode 600)."""
    path = home / ADMIN_KEY_FILE
    if path.exists():
        return path.read_text().strip(), False
    home.mkdir(parents=True, exist_ok=True)
    key = "sk-sparring-" + secrets.token_urlsafe(24)
    path.touch(mode=0o600)
    path.write_text(key + "\n")
    return key, True


def build_keyring(settings: Settings, extra: list[ApiKey] | None = None) -> KeyRing:
    return KeyRing(keys=tuple(settings.keys + (extra or [])), header=settings.auth_header)
