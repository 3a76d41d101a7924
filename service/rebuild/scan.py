"""Step 1 of a rebuild: list every region for its MANIFEST.json objects.

A region that cannot be listed (not even partly: a partial listing is
discarded) counts as unreachable; its replicas are recorded ``pending`` and a
later rebuild fills them in.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import defaultdict

from ..storage import layout
from ..storage.base import ObjectInfo, ObjectStore, StoreError
from .context import Context

log = logging.getLogger("tierckpt.rebuild")

MANIFEST_KEY = re.compile(
    r"^(?P<run>[A-Za-z0-9._-]{1,128})/step-(?P<step>[0-9]{12})/"
    + re.escape(layout.MANIFEST_NAME)
    + "$"
)

# (run, step) -> region -> its MANIFEST.json
Found = dict[tuple[str, int], dict[str, ObjectInfo]]


async def scan_region(store: ObjectStore) -> list[tuple[str, int, ObjectInfo]]:
    await store.ensure_ready()
    found = []
    async for info in store.list(""):
        match = MANIFEST_KEY.match(info.key)
        if match:
            found.append((match["run"], int(match["step"]), info))
    return found


async def scan(ctx: Context) -> Found:
    """Every manifest of every reachable region; the others are noted in
    ``ctx.unreachable`` and the report."""
    names = list(ctx.stores)
    scans = await asyncio.gather(
        *(scan_region(ctx.stores[name]) for name in names), return_exceptions=True
    )
    found: Found = defaultdict(dict)
    for name, outcome in zip(names, scans, strict=True):
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):
                raise outcome
            message = (
                str(outcome)
                if isinstance(outcome, StoreError)
                else (f"{type(outcome).__name__}: {outcome}")
            )
            log.warning("region %s unreachable: %s", name, message)
            ctx.unreachable.add(name)
            ctx.report.regions_unreachable.append({"region": name, "error": message})
            continue
        log.info("region %s: %d manifest(s)", name, len(outcome))
        for run, step, info in outcome:
            found[(run, step)][name] = info
    return found
