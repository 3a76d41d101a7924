"""The `latest` answer, read and written as JSON straight from the catalog's rows.

`latest` is asked on every restart and by orchestrators polling. Its read is
two statements on the event loop's own connection on SQLite (or one
statement on the read pool on PostgreSQL: row_reads.py), and its answer is
written here as a plain dict and serialized once, without building the
response models (about a tenth of its CPU). The document is
presenter.latest_document's, the documented `LatestOut` (schemas.py) field
for field and in its order; the tests hold the two together (each answer
validates as a LatestOut that serializes back to the same JSON,
and equals the checkpoint's detail view).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import BadInput, NotFound
from ..prefetch import copies
from ..resources import Resources
from ..row_reads import RowReaders
from . import repository as repo
from .presenter import Listing, latest_document, to_json
from .repository import LatestRows

T = TypeVar("T")


async def latest_json(
    resources: Resources, run: str, region: str | None, node: str | None
) -> bytes:
    """The latest valid checkpoint of ``run`` as the JSON of a LatestOut;
    BadInput for an unknown region, NotFound when none is valid yet."""
    if region is not None and region not in resources.stores:
        raise BadInput(
            f"unknown region {region!r}; configured: {', '.join(resources.stores)}",
            code="unknown_region",
        )
    rows = await read_latest_rows(
        resources.rows, run, resources.settings.durability.min_regions, region
    )
    if rows is None:
        where = f" in region {region}" if region else ""
        raise NotFound(
            f"run {run!r} has no valid checkpoint{where} yet", code="no_valid_checkpoint"
        )
    local = await _local_copy(resources, run, rows, node)
    listing = Listing(
        shards=rows.shards,
        replicas=rows.replicas,
        children=rows.children,
        files=rows.files,
        regions=list(resources.stores),
    )
    return to_json(latest_document(run, rows.checkpoint, listing, local))


async def read_latest_rows(
    rows: RowReaders, run: str, min_regions: int, region: str | None
) -> LatestRows | None:
    """The catalog read behind `latest` (the benchmark times it alone too):
    on SQLite two statements in one snapshot on the event loop's own
    connection, on PostgreSQL one statement on the read pool
    (row_reads.py)."""
    return await rows.read(repo.latest_rows, run, min_regions, region)


async def read_whole(resources: Resources, read: Callable[..., T], *args: Any) -> T:
    """Any other whole read of rows on the hot path, the way `latest`'s is
    read: ``read(connection, *args)`` (row_reads.py)."""
    return await resources.rows.read(read, *args)


async def _local_copy(
    resources: Resources, run: str, rows: LatestRows, node: str | None
) -> dict[str, Any] | None:
    """This node's intact T0 copies of the checkpoint's ranks, only when this
    agent is that node and can check their files are still exactly what was
    verified: its own (the directories the ranks were registered from; size
    and mtime as uploaded), else a prefetched copy's (prefetch/copies.py).
    ``ranks`` maps each intact rank to its directory; ``path`` is rank 0's
    (None when rank 0 is not intact here)."""
    if node is None or node != resources.settings.server.node:
        return None
    settings = resources.settings
    checkpoint = rows.checkpoint

    def intact_ranks() -> dict[int, str]:
        ranks = copies.own_intact_ranks(
            node,
            [(s.rank, s.node, s.path) for s in rows.shards],
            [(f.rank, f.file_path, f.file_size, f.file_mtime_ns) for f in rows.files],
        )
        if len(ranks) < checkpoint.world_size:
            prefetched = copies.intact_ranks(
                copies.step_dir(settings, run, checkpoint.step),
                checkpoint.id,
                [(f.rank, f.file_path, f.file_size, f.file_sha256) for f in rows.files],
            )
            ranks = {**prefetched, **ranks}
        return dict(sorted(ranks.items()))

    ranks = await asyncio.to_thread(intact_ranks)
    if not ranks:
        return None
    return {"node": node, "path": ranks.get(0), "ranks": {str(r): p for r, p in ranks.items()}}
