"""One error base carrying an HTTP status and a stable code, rendered by one handler."""

from __future__ import annotations

from typing import Any, ClassVar

import orjson
from fastapi import Request, Response


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


async def handle_outage(request: Request, exc: Exception) -> Response:
    """A database or network error that escaped a route: the dependency is down, so 503, never 500."""
    settings = getattr(request.app.state, "settings", None)
    retry_after = int(getattr(settings, "retry_after_seconds", 2))
    error = ServiceUnavailable(f"a dependency is unreachable: {type(exc).__name__}", retry_after=retry_after)
    return await handle_sparring_error(request, error)
