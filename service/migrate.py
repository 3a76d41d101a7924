"""Bring a catalog to the newest schema with Alembic (run at `serve` start)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import tierckpt.migrations

MIGRATIONS_DIR = Path(tierckpt.migrations.__file__).parent


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # '%' would be read as interpolation by configparser.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["configure_logger"] = False
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Synchronous on purpose: env.py runs its own event loop for the async engine."""
    command.upgrade(alembic_config(url), revision)


def check(url: str) -> None:
    """Raise if the models and the migrations disagree (alembic check)."""
    command.check(alembic_config(url))
