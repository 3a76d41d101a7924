"""The agent's error answers: the exception handlers that word every error as
``{"error": {"code", "message"}}`` (errors.py), and that shape in the
OpenAPI document."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import CATALOG_RETRY_AFTER, DRIVER_ERRORS, ApiError, error_body, is_catalog_outage

log = logging.getLogger("tierckpt.api")


def catalog_unavailable() -> JSONResponse:
    return JSONResponse(
        error_body("catalog_unavailable", "the catalog database is unreachable; retry shortly"),
        status_code=503,
        headers={"Retry-After": CATALOG_RETRY_AFTER},
    )


def api_error(exc: ApiError) -> JSONResponse:
    """The answer to an ApiError (errors.py): its status, its code and message."""
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else exc.headers
    return JSONResponse(error_body(exc.code, exc.message), status_code=exc.status, headers=headers)


def _internal_error() -> JSONResponse:
    return JSONResponse(
        error_body("internal_error", "unexpected server error; see the agent's log"),
        status_code=500,
    )


# The JSON error shape, documented on every operation (see document_errors).
ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {"type": "string", "description": "snake_case, stable"},
                "message": {"type": "string", "description": "what to do about it"},
            },
        }
    },
}
_ERROR_REF = {"$ref": "#/components/schemas/Error"}
_DOCUMENTED_ERRORS = {
    "4XX": "bad input, not found, conflict, authentication (401/403), body too large "
    "(413) or rate limited (429, with Retry-After)",
    "422": "the request does not match the schema",
    "503": "the catalog database is unreachable (`catalog_unavailable`), or the agent is "
    "shutting down (`draining`: normal registrations only); retry after Retry-After seconds",
}


def document_errors(app: FastAPI) -> None:
    """Put the error shape into the OpenAPI schema: every operation may answer
    4xx and 503 with ``{"error": {"code", "message"}}``, and 422 uses that
    shape too (FastAPI would document its own ``{"detail": [...]}``)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["Error"] = ERROR_SCHEMA
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                for status, description in _DOCUMENTED_ERRORS.items():
                    responses[status] = {
                        "description": description,
                        "content": {"application/json": {"schema": _ERROR_REF}},
                    }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors()[:10]:
        location = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return api_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            error_body("invalid_request", _describe_validation(exc)), status_code=422
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(
            error_body(code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(DBAPIError)
    async def _catalog_error(_request: Request, exc: DBAPIError) -> JSONResponse:
        if is_catalog_outage(exc):
            log.warning("catalog unavailable: %s", exc)
            return catalog_unavailable()
        if isinstance(exc, DataError):
            # e.g. a number beyond the column's range; the input, not the server.
            return JSONResponse(
                error_body("invalid_value", f"a value is out of range or malformed: {exc.orig}"),
                status_code=422,
            )
        if isinstance(exc, IntegrityError):
            return JSONResponse(
                error_body("conflict", "the request conflicts with a concurrent change; retry"),
                status_code=409,
            )
        log.error("catalog query failed", exc_info=exc)
        return _internal_error()

    @app.exception_handler(OverflowError)
    async def _overflow(_request: Request, exc: OverflowError) -> JSONResponse:
        # SQLite's driver refuses integers beyond 64 bits before any query runs.
        return JSONResponse(
            error_body("invalid_value", f"a number is out of range: {exc}"), status_code=422
        )

    async def _outage_or_internal(_request: Request, exc: Exception) -> JSONResponse:
        if is_catalog_outage(exc):
            log.warning("catalog unavailable: %s", exc)
            return catalog_unavailable()
        log.error("unexpected error", exc_info=exc)
        return _internal_error()

    # Errors of the driver or the socket that SQLAlchemy did not wrap (they
    # happen while connecting), and the pool running dry.
    for kind in (OSError, PoolTimeout, *DRIVER_ERRORS):
        app.add_exception_handler(kind, _outage_or_internal)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        if is_catalog_outage(exc):
            return catalog_unavailable()
        log.exception("unexpected error")
        return _internal_error()

    document_errors(app)
