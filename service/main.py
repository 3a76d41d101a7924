"""Entry points behind `tierckpt serve` and `tierckpt migrate`."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import cpu_affinity
from .config import ConfigError, Settings, load_settings

if TYPE_CHECKING:
    from .rebuild import RebuildReport


def _settings_or_exit(config_path: str | None) -> Settings:
    try:
        return load_settings(config_path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def check_machine(settings: Settings) -> None:
    """What the configuration asks of this machine, refused before serving."""
    cpus = settings.worker.cpu_set
    if cpus:
        try:
            cpu_affinity.usable(cpus)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from exc


def migrate(config_path: str | None = None) -> None:
    from .migrate import upgrade

    settings = _settings_or_exit(config_path)
    upgrade(settings.catalog.url)


def serve(config_path: str | None = None) -> None:
    import uvicorn

    from .allocator import return_large_buffers_to_os
    from .app import create_app
    from .migrate import upgrade
    from .observability.logs import configure_logging
    from .server import DrainingServer

    # Before any part buffer exists: bounded parts must mean bounded RSS.
    return_large_buffers_to_os()
    settings = _settings_or_exit(config_path)
    check_machine(settings)
    # JSON lines (with request and job context) unless a person is watching.
    configure_logging(settings.server.log_format)
    upgrade(settings.catalog.url)
    app = create_app(settings, worker_process=True)
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level="info",
        # uvicorn's loggers propagate to the root handler configured above.
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.worker.shutdown_timeout) + 5,
    )
    # SIGTERM drains (server.py): the node's work, urgent first, runs for up
    # to [worker] drain_seconds; then the lifespan shutdown gives back the rest.
    server = DrainingServer(config, app, settings.worker.drain_seconds)
    server.run()
    if not server.started:
        raise SystemExit(3)


def rebuild_catalog(
    config_path: str | None,
    *,
    as_json: bool = False,
    show: Callable[[RebuildReport], None],
) -> int:
    """`tierckpt rebuild-catalog`: recreate a lost catalog from the regions'
    manifests (see tierckpt.service.rebuild). The report is printed as JSON,
    or handed to ``show`` (the CLI renders it for people). Exit code: 0 done
    (corrupt or missing replicas are reported, not failures), 2 bad
    configuration, 3 the catalog or every region unreachable, so nothing
    could be rebuilt."""
    import asyncio
    import json

    from .rebuild import CatalogUnreachable, rebuild

    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    progress = logging.getLogger("tierckpt.rebuild")
    if not progress.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        progress.addHandler(handler)
        progress.propagate = False
    # Machines get warnings only on stderr; people also see the progress.
    progress.setLevel(logging.WARNING if as_json else logging.INFO)
    try:
        report = asyncio.run(rebuild(settings))
    except CatalogUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        show(report)
    if report.nothing_reachable:
        print("error: no region could be reached; nothing was rebuilt", file=sys.stderr)
        return 3
    return 0
