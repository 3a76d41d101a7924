"""Log records with their context, as JSON lines or readable console lines.

``ContextFilter`` copies the request id and the current job (id, kind, run,
step, region, attempt) onto every record that passes the handler, so a plain
``log.info("…")`` anywhere in the service is attributable. ``JsonFormatter``
writes one JSON object per line (for log shippers); ``ConsoleFormatter`` is
for a person at a terminal. ``configure_logging`` installs one of them on the
root logger; uvicorn's own loggers propagate there (``log_config=None``).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any, Literal

from .context import JOB, REQUEST_ID

# Attributes every LogRecord has; anything else on a record came from the
# context filter or from ``extra=`` and belongs in the output.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",  # uvicorn's coloured duplicate of the message
}
# Shown by the console format, in this order, when present.
_CONSOLE_KEYS = ("request_id", "job_id", "job_kind", "run", "step", "region")


class ContextFilter(logging.Filter):
    """Adds ``request_id`` and the current job's fields to each record
    (never overwriting what the caller passed in ``extra``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = REQUEST_ID.get()
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        job = JOB.get()
        if job is not None:
            for key, value in job.fields().items():
                if not hasattr(record, key):
                    setattr(record, key, value)
        return True


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {
        key: value
        for key, value in record.__dict__.items()
        if key not in _STANDARD and not key.startswith("_")
    }


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, then the context."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class ConsoleFormatter(logging.Formatter):
    """``12:00:01 INFO tierckpt.worker: message  [job_id=3 run=llama step=100]``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        shown = [f"{key}={extras[key]}" for key in _CONSOLE_KEYS if key in extras]
        if shown:
            first, newline, rest = line.partition("\n")
            line = f"{first}  [{' '.join(shown)}]{newline}{rest}"
        return line


LogFormat = Literal["auto", "json", "console"]


def resolve_format(log_format: LogFormat, stream: IO[str]) -> Literal["json", "console"]:
    if log_format != "auto":
        return log_format
    isatty = getattr(stream, "isatty", None)
    return "console" if isatty is not None and isatty() else "json"


def make_handler(log_format: LogFormat, stream: IO[str] | None = None) -> logging.Handler:
    stream = stream if stream is not None else sys.stderr
    handler = logging.StreamHandler(stream)
    chosen = resolve_format(log_format, stream)
    handler.setFormatter(JsonFormatter() if chosen == "json" else ConsoleFormatter())
    handler.addFilter(ContextFilter())
    handler._tierckpt = True  # type: ignore[attr-defined]
    return handler


def configure_logging(
    log_format: LogFormat = "auto", level: int = logging.INFO, stream: IO[str] | None = None
) -> logging.Handler:
    """Route every logger through one handler on the root logger (replacing
    the one a previous call installed)."""
    root = logging.getLogger()
    for existing in list(root.handlers):
        if getattr(existing, "_tierckpt", False):
            root.removeHandler(existing)
    handler = make_handler(log_format, stream)
    root.addHandler(handler)
    root.setLevel(level)
    return handler
