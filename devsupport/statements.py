"""The SQL statements an agent's catalog engine runs, recorded for a test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine


def starting(prefix: str) -> Callable[[str], bool]:
    """Statements beginning with ``prefix`` (case and leading space ignored)."""
    wanted = prefix.upper()
    return lambda statement: statement.lstrip().upper().startswith(wanted)


@contextmanager
def recorded(engine: AsyncEngine, match: Callable[[str], bool]) -> Iterator[list[str]]:
    """The statements ``match`` accepts that ``engine`` runs inside the block,
    in order (the list fills as they run)."""
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if match(statement):
            seen.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", record)
