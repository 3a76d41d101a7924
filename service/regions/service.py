"""Serving the objects of POSIX regions: which file answers a request.

The checks that touch the file system (is it there, how large) run in a
worker thread: a slow or hung mount must not stall the event loop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ..errors import BadInput, NotFound
from ..observability import metrics
from ..storage.factory import Stores
from ..storage.posix import PosixStore


def _served_size(path: Path) -> int | None:
    """The file's size, or None when there is no file (a directory, nothing)."""
    if not path.is_file():
        return None
    return path.stat().st_size


async def object_file(stores: Stores, region: str, key: str, range_header: str | None) -> Path:
    """The file holding ``key`` in the POSIX region ``region``, counted as
    served; NotFound or BadInput (an S3 region, an invalid key) otherwise."""
    store = stores.get(region)
    if store is None:
        raise NotFound(f"unknown region {region!r}", code="unknown_region")
    if not isinstance(store, PosixStore):
        raise BadInput(f"region {region!r} is S3; use the presigned URL from the restore plan")
    try:
        path = store.local_path(key)
    except Exception as exc:
        raise BadInput(f"invalid object key {key!r}", code="invalid_key") from exc
    size = await asyncio.to_thread(_served_size, path)
    if size is None:
        raise NotFound(f"object {key!r} not found in region {region!r}", code="object_not_found")
    metrics.observe_served(region, range_header, size)
    return path
