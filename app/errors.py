"""One error base carrying an HTTP status and a stable code, rendered by one handler."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import orjson
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException


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


class InvalidRequest(SparringError):
    """A request of the right syntax whose fields have the wrong types or values (FastAPI's 422)."""

    status_code = 422
    code = "invalid_request"


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


def describe_validation_errors(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """Pydantic's errors without the values that failed (`input`, `ctx`): where, what and why only.

    The values are the caller's own bytes: NaN, a lone surrogate or a 1,000-level list that no JSON
    encoder writes, or megabytes echoed back; the location and the message say enough.
    """
    described: list[dict[str, Any]] = []
    for error in errors[:20]:
        if not isinstance(error, Mapping):
            continue
        location = [part if isinstance(part, int) else _plain(part, 100) for part in error.get("loc", ())]
        described.append(
            {
                "loc": location[:16],
                "msg": _plain(error.get("msg", ""), 300),
                "type": _plain(error.get("type", ""), 100),
            }
        )
    return described


def _plain(value: Any, limit: int) -> str:
    """`value` as text any encoder writes: a str, cut to `limit`, lone surrogates replaced."""
    text = value if isinstance(value, str) else type(value).__name__
    return text[:limit].encode("utf-8", "replace").decode()


async def handle_validation_error(request: Request, exc: Exception) -> Response:
    """FastAPI's request validation (a bad query, path or body field): a 422 with the stable body."""
    assert isinstance(exc, RequestValidationError)
    error = InvalidRequest(
        "the request does not match the route's parameters", errors=describe_validation_errors(exc.errors())
    )
    return json_response(error.body(), status_code=error.status_code)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized", 403: "forbidden"}


async def handle_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 4xx (no route at this path, a method the route does not take): the stable body
    instead of `{"detail": ...}`, with the headers it carries (`Allow` on a 405)."""
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, "bad_request" if exc.status_code < 500 else "internal_error")
    if exc.status_code == 404:
        message = f"no route {request.url.path[:200]!r}: see GET /docs for the routes"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow") or "?"
        message = f"{request.url.path[:200]!r} does not take {request.method} (it takes {allowed})"
    else:
        message = str(exc.detail)[:300]
    return json_response(
        {"error": {"code": code, "message": message}}, exc.status_code, dict(exc.headers or {})
    )


INTERNAL_ERROR: dict[str, Any] = {
    "error": {"code": "internal_error", "message": "unexpected server error; see the server log"}
}


async def handle_unexpected_error(request: Request, exc: Exception) -> Response:
    """A bug in sparring: the stable JSON body of a 500 instead of Starlette's plain text.

    Starlette's error middleware logs the exception and raises it on to the server after answering.
    """
    return json_response(INTERNAL_ERROR, status_code=500)


# A database, Redis or network failure: infrastructure, never the caller's or the model's fault.
OUTAGES: tuple[type[Exception], ...] = (SQLAlchemyError, RedisError, OSError)


def outage(exc: BaseException, retry_after: int) -> ServiceUnavailable:
    """The one translation of an OUTAGES error into the 503 (with Retry-After) that answers it.

    The caller gets a stable message; the driver's words (hosts, ports, error kinds) go to the log.
    """
    log.warning("a dependency failed: %s: %s", type(exc).__name__, exc)
    return ServiceUnavailable("a dependency is unreachable", retry_after=retry_after)


def answer_to(exc: BaseException, retry_after: int) -> SparringError | None:
    """The error a request answers for `exc`: a SparringError as it is, an outage as its 503, and None
    for a bug (a 500). For the paths FastAPI's handlers do not see: the tool fast path and MCP."""
    if isinstance(exc, SparringError):
        return exc
    if isinstance(exc, OUTAGES):
        return outage(exc, retry_after)
    return None
