"""Entry points behind `tierckpt serve` and `tierckpt migrate`."""

from __future__ import annotations

import logging
import sys

from .config import ConfigError, Settings, load_settings


def _settings_or_exit(config_path: str | None) -> Settings:
    try:
        return load_settings(config_path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def migrate(config_path: str | None = None) -> None:
    from .migrate import upgrade

    settings = _settings_or_exit(config_path)
    upgrade(settings.catalog.url)


def serve(config_path: str | None = None) -> None:
    import uvicorn

    from .app import create_app
    from .migrate import upgrade

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = _settings_or_exit(config_path)
    upgrade(settings.catalog.url)
    app = create_app(settings)
    # uvicorn turns SIGTERM into a lifespan shutdown: the worker stops
    # claiming, lets running jobs finish for a grace period, then releases them.
    uvicorn.run(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=int(settings.worker.shutdown_timeout) + 5,
    )
