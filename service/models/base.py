"""Declarative base shared by every catalog table, and the clock the catalog uses."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import MetaData, text
from sqlalchemy.orm import DeclarativeBase

# Named constraints keep Alembic migrations identical on SQLite and PostgreSQL.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def not_null(column: str) -> dict[str, Any]:
    """The keyword arguments of an Index holding only rows where ``column``
    is set (a partial index, on both databases). Queries comparing the
    column with ``=`` use it; the rows left out cost no index write."""
    condition = text(f"{column} IS NOT NULL")
    return {"sqlite_where": condition, "postgresql_where": condition}


def utcnow() -> datetime:
    """Naive UTC: SQLite has no time zones, so every timestamp is stored as UTC."""
    return datetime.now(UTC).replace(tzinfo=None)
