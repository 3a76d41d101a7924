"""Domain errors that carry their HTTP meaning, and the JSON error shape.

Every error leaves as ``{"error": {"code", "message"}}``; bad input is a 4xx
whose message says what to change, never a 500 or a traceback. The answers
themselves (the handlers, the OpenAPI's error schema) are in
error_responses.py: the worker process raises and tells these errors apart
without loading the web framework.
"""

from __future__ import annotations

import socket

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

try:  # the PostgreSQL driver; its errors can escape SQLAlchemy while connecting
    import asyncpg

    _DRIVER_OUTAGES: tuple[type[BaseException], ...] = (
        asyncpg.exceptions.PostgresConnectionError,
        asyncpg.exceptions.InterfaceError,
        # 57P0x: the server is shutting down, restarting or not accepting yet.
        asyncpg.exceptions.OperatorInterventionError,
    )
    DRIVER_ERRORS: tuple[type[BaseException], ...] = (
        asyncpg.exceptions.PostgresError,
        asyncpg.exceptions.InterfaceError,
    )
except ImportError:  # pragma: no cover - asyncpg is a dependency
    _DRIVER_OUTAGES = DRIVER_ERRORS = ()


class ApiError(Exception):
    status = 400
    code = "bad_request"

    # Extra response headers (Retry-After on a 503).
    headers: dict[str, str] | None = None

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status


class BadInput(ApiError):
    status = 400
    code = "bad_request"


class NotFound(ApiError):
    status = 404
    code = "not_found"


class Conflict(ApiError):
    status = 409
    code = "conflict"


class Unauthorized(ApiError):
    status = 401
    code = "unauthorized"


class Forbidden(ApiError):
    status = 403
    code = "forbidden"


class Unavailable(ApiError):
    status = 503
    code = "unavailable"


def error_body(code: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"code": code, "message": message}}


def is_catalog_outage(exc: BaseException) -> bool:
    """The catalog could not be reached or dropped the connection (retry
    later), as opposed to a query it refused (bad value, conflict, bug)."""
    if isinstance(exc, (OperationalError, InterfaceError, PoolTimeout)):
        return True
    if isinstance(exc, DBAPIError):
        return bool(exc.connection_invalidated) or is_catalog_outage(exc.orig or Exception())
    if isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror)):
        return True
    return isinstance(exc, _DRIVER_OUTAGES)


# Seconds a client is told to wait before retrying when the catalog failed it.
CATALOG_RETRY_AFTER = "2"


def catalog_failed(message: str) -> Unavailable:
    """The same 503 (``catalog_unavailable``, Retry-After) with a message of
    the caller's, for a failure it knows more about than an outage."""
    error = Unavailable(message, code="catalog_unavailable")
    error.headers = {"Retry-After": CATALOG_RETRY_AFTER}
    return error
