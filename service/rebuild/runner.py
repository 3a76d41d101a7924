"""The rebuild itself: migrate the catalog, scan the regions, then rebuild
each (run, step) found, a few checkpoints at a time.

Per checkpoint: read the regions whose copy could still change (all that
hold a manifest for a new checkpoint; for a known one only those whose
replica is missing or pending), then write the outcome in one transaction
(``catalog.create`` or ``catalog.fill``). Checkpoints whose row is
``failed`` or ``deleted`` are left alone.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from ..checkpoints import repository as repo
from ..checkpoints.state import FINAL
from ..concurrency import for_each_bounded
from ..config import Settings
from ..db import create_engine, create_sessionmaker, transaction
from ..migrate import upgrade
from ..models import ReplicaState
from ..storage.base import ObjectInfo
from ..storage.factory import build_stores
from .catalog import create, fill, known_checkpoint
from .check import RegionCheck, check_region, choose_manifest
from .context import Context
from .report import (
    MISSING,
    UNVERIFIED,
    CatalogUnreachable,
    CheckpointResult,
    RebuildReport,
    RegionResult,
)
from .scan import scan

log = logging.getLogger("tierckpt.rebuild")


async def _rebuild_checkpoint(
    ctx: Context, run: str, step: int, found: dict[str, ObjectInfo]
) -> CheckpointResult | None:
    async with transaction(ctx.sessionmaker) as session:
        known = await known_checkpoint(session, run, step)
    # Which regions to read: all that hold a manifest for a new checkpoint;
    # for a known one only those whose replica could still change.
    to_check = [
        name
        for name in ctx.stores
        if name in found
        and (
            known is None
            or (
                known.state not in FINAL
                and known.replicas.get(name) in (None, ReplicaState.PENDING)
            )
        )
    ]
    checked = await asyncio.gather(
        *(check_region(ctx, ctx.stores[name], run, step, found[name]) for name in to_check)
    )
    checks = dict(zip(to_check, checked, strict=True))
    if known is None and choose_manifest(checks, list(ctx.stores)) is None:
        return _skipped(ctx, run, step, checks, found)

    for _attempt in range(2):
        try:
            async with transaction(ctx.sessionmaker) as session:
                run_row = await repo.get_or_create_run(session, run)
                checkpoint = await repo.find_checkpoint(session, run_row.id, step, for_update=True)
                if checkpoint is not None:
                    return await fill(session, ctx, checkpoint, run, checks, found)
                winner = choose_manifest(checks, list(ctx.stores))
                if winner is None:
                    # Deleted from the catalog since it was read: nothing to create from.
                    return _skipped(ctx, run, step, checks, found)
                return await create(session, ctx, run_row.id, run, step, winner, checks, found)
        except IntegrityError:
            # An agent created the same run/step meanwhile: the next attempt
            # takes the existing-checkpoint path.
            continue
    raise CatalogUnreachable(f"{run}:{step} could not be written to the catalog")


def _skipped(
    ctx: Context,
    run: str,
    step: int,
    checks: dict[str, RegionCheck],
    found: dict[str, ObjectInfo],
) -> CheckpointResult | None:
    """No usable manifest. Only invalid ones (already reported): not a
    checkpoint. Some unreadable: say so, a rerun may rebuild it."""
    if not any(c.status == UNVERIFIED for c in checks.values()):
        return None
    regions = {}
    for name in ctx.stores:
        check = checks.get(name)
        if check is None:
            regions[name] = RegionResult(ctx.status_unchecked(name, found), None)
        else:
            regions[name] = RegionResult(check.status or MISSING, None, check.error)
    return CheckpointResult(
        run=run,
        step=step,
        action="skipped",
        state=None,
        regions=regions,
        error="no readable manifest; rerun rebuild-catalog once the region is reachable",
    )


def _catalog_error(url: str, exc: BaseException) -> CatalogUnreachable:
    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except Exception:
        shown = "<catalog>"
    return CatalogUnreachable(f"catalog {shown}: {type(exc).__name__}: {exc}")


async def rebuild(
    settings: Settings, *, objects_in_flight: int = 4, checkpoints_in_flight: int = 2
) -> RebuildReport:
    """Recreate (or complete) the catalog from every configured region's manifests.

    Raises CatalogUnreachable when the catalog cannot be migrated or written.
    Regions that cannot be reached are in ``report.regions_unreachable``.
    """
    url = settings.catalog.url
    try:
        await asyncio.to_thread(upgrade, url)
    except Exception as exc:
        raise _catalog_error(url, exc) from exc
    engine = create_engine(url)
    stores = build_stores(settings)
    report = RebuildReport(regions=list(stores))
    ctx = Context(
        settings=settings,
        stores=stores,
        sessionmaker=create_sessionmaker(engine),
        slots=asyncio.Semaphore(objects_in_flight),
        objects_in_flight=objects_in_flight,
        report=report,
        unreachable=set(),
    )
    try:
        found = await scan(ctx)
        results: dict[tuple[str, int], CheckpointResult] = {}

        async def one(item: tuple[tuple[str, int], dict[str, ObjectInfo]]) -> None:
            (run, step), where = item
            result = await _rebuild_checkpoint(ctx, run, step, where)
            if result is not None:
                results[(run, step)] = result
                log.info(
                    "%s:%d %s, %s (%s)",
                    run,
                    step,
                    result.action,
                    result.state,
                    ", ".join(f"{n} {r.status}" for n, r in result.regions.items()),
                )

        try:
            await for_each_bounded(sorted(found.items()), checkpoints_in_flight, one)
        except (SQLAlchemyError, OSError) as exc:
            raise _catalog_error(url, exc) from exc
        report.checkpoints = [results[k] for k in sorted(results)]
        report.manifests_invalid.sort(key=lambda e: (e["region"], e["key"]))
        return report
    finally:
        await stores.aclose()
        await engine.dispose()
