"""One error base carrying an HTTP status and a stable code, rendered by one handler."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import orjson
from fastapi import Request, Response
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError


class StartupError(RuntimeError):
    """The server cannot start as configured; the message says what to change."""


log = logging.getLogger(__name__)


class SparringError(Exception):
    status_code: ClassVar[int] = 400
    code: ClassVar[str] = "bad_request"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def headers(self) -> dict[str, str]:
        return {}

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            error["details"] = self.details
        return {"error": error}


class BadRequest(SparringError):
    status_code = 400
    code = "bad_request"


class Unauthorized(SparringError):
    status_code = 401
    code = "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class Forbidden(SparringError):
    status_code = 403
    code = "forbidden"


class NotFound(SparringError):
    status_code = 404
    code = "not_found"


class PayloadTooLarge(SparringError):
    status_code = 413
    code = "payload_too_large"


class ToolCrashed(SparringError):
    """A tool raised an unexpected exception: the environment is broken, the rollout must not train."""

    status_code = 500
    code = "tool_crashed"


class ServiceUnavailable(SparringError):
    """Infrastructure is down or overloaded: the trainer retries, then discards the rollout."""

    status_code = 503
    code = "unavailable"

    def __init__(self, message: str, retry_after: int = 2, **details: Any) -> None:
        super().__init__(message, **details)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


def json_response(body: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body), status_code=status_code, headers=headers, media_type="application/json"
    )


async def handle_sparring_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SparringError)
    return json_response(exc.body(), status_code=exc.status_code, headers=exc.headers())


# A database, Redis or network failure: infrastructure, never the caller's or the model's fault.
OUTAGES: tuple[type[Exception], ...] = (SQLAlchemyError, RedisError, OSError)


def outage(exc: BaseException, retry_after: int) -> ServiceUnavailable:
    """The one translation of an OUTAGES error into the 503 (with Retry-After) that answers it.

    The caller gets a stable message; the driver's words (hosts, ports, error kinds) go to the log.
    """
    log.warning("a dependency failed: %s: %s", type(exc).__name__, exc)
    return ServiceUnavailable("a dependency is unreachable", retry_after=retry_after)
