"""Exceptions raised by the tierckpt client, and their mapping from HTTP answers.

Every error the service sends has the body ``{"error": {"code", "message"}}``
(docs/API.md); :func:`error_from_response` turns such an answer into the
exception class callers catch, so nobody has to look at status codes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from .models import Checkpoint


class TierckptError(Exception):
    """Base of every error this client raises on purpose."""

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status


class NotFoundError(TierckptError):
    """The run, checkpoint or object does not exist (404)."""


class BadRequestError(TierckptError):
    """The service refused the request as invalid (a 4xx other than 404)."""


class ConflictError(BadRequestError):
    """The request contradicts existing state (409), e.g. re-registering a
    step with different content, or restoring a step that is not durable yet."""


class AuthError(BadRequestError):
    """The token is missing, unknown, or lacks the role for this run (401/403)."""


class ServerError(TierckptError):
    """The service failed (5xx), or could not be reached in time."""


class RestoreError(TierckptError):
    """A restore could not produce a verified copy: every source failed, the
    plan was unsafe, or the local write failed. Nothing is left behind."""


class DestinationError(RestoreError):
    """The restore destination is unusable (exists and is not an empty
    directory); a usage error rather than a failure of the service."""


class CheckpointFailedError(TierckptError):
    """A checkpoint being waited for ended ``failed``, ``corrupt`` or ``deleted``."""

    def __init__(self, message: str, checkpoint: Checkpoint):
        super().__init__(message, code=f"checkpoint_{checkpoint.state}")
        self.checkpoint = checkpoint


def _error_fields(response: httpx.Response) -> tuple[str | None, str]:
    """Extract (code, message) from the contract body, tolerating FastAPI's own
    ``{"detail": ...}`` answers (unknown route, framework-level validation) and
    non-JSON bodies from proxies."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            code = error.get("code")
            return (str(code) if code else None), str(error["message"])
        detail = body.get("detail")
        if isinstance(detail, str):
            return None, detail
        if isinstance(detail, list) and detail:
            parts = []
            for item in detail:
                if isinstance(item, dict):
                    where = ".".join(str(p) for p in item.get("loc", ()))
                    parts.append(f"{where}: {item.get('msg', item)}" if where else str(item))
                else:
                    parts.append(str(item))
            return "validation_error", "; ".join(parts)
    text = response.text.strip()[:200]
    reason = response.reason_phrase or "error"
    return None, f"HTTP {response.status_code} {reason}" + (f": {text}" if text else "")


def error_from_response(response: httpx.Response) -> TierckptError:
    """The exception for a non-2xx answer of the service."""
    status = response.status_code
    code, message = _error_fields(response)
    cls: type[TierckptError]
    if status == 404:
        cls = NotFoundError
    elif status == 409:
        cls = ConflictError
    elif status in (401, 403):
        cls = AuthError
    elif 400 <= status < 500:
        cls = BadRequestError
    else:
        cls = ServerError
    return cls(message, code=code, status=status)


def error_from_transport(exc: httpx.HTTPError, base_url: str) -> ServerError:
    """The exception for a request that got no answer at all."""
    if isinstance(exc, httpx.TimeoutException):
        message = f"timed out talking to the tierckpt service at {base_url}"
        return ServerError(message, code="timeout")
    if isinstance(exc, httpx.ConnectError):
        message = f"cannot reach the tierckpt service at {base_url} ({exc})"
        return ServerError(message, code="unreachable")
    return ServerError(f"request to {base_url} failed: {exc}", code="transport_error")
