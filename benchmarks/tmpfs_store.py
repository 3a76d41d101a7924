"""An S3 server whose data lives on a tmpfs, for scenarios that time uploads
as users see them: a remote store does not share the agent's disk, and one
on the agent's disk makes every upload pay twice for the same device.

``/dev/shm`` when it is writable, else the work directory (said in the
result). Memory is what the data occupies, so a scenario frees what it wrote
between repetitions (``empty``): objects deleted, then the volumes vacuumed,
which is what gives SeaweedFS's space back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from devsupport.seaweed import SeaweedServer, boto3_client

from .context import VOLUME_SIZE_LIMIT_MB


@contextlib.contextmanager
def tmpfs_seaweed(work: Path, buckets: tuple[str, ...]) -> Iterator[tuple[SeaweedServer, str]]:
    """A running SeaweedFS on a tmpfs with ``buckets``, and the directory it is under."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else work
    # Named after the work directory: the watchdog (leftovers.py) finds it by that.
    data = Path(tempfile.mkdtemp(prefix=f"{work.name}-s3-", dir=base))
    server = SeaweedServer(data, volume_size_limit_mb=VOLUME_SIZE_LIMIT_MB)
    try:
        server.start()
        for bucket in buckets:
            server.create_bucket(bucket)
        yield server, str(base)
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


def empty(server: SeaweedServer, bucket: str, prefix: str = "") -> int:
    """Delete every object under ``prefix`` and vacuum the volumes; the bytes deleted."""
    client: Any = boto3_client(server.endpoint_url)
    freed = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        freed += sum(item["Size"] for item in page.get("Contents", []))
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    if not freed:
        return 0  # nothing deleted, nothing to compact (earlier deletes were)
    vacuum(server)
    return freed


def vacuum(server: SeaweedServer, timeout: float = 120.0) -> float:
    """Compact the volumes: a deleted needle keeps its bytes (on a tmpfs, the
    node's memory) until its volume is compacted. A store on other machines
    keeps its garbage there; here it would fill the node's RAM. The seconds
    it took."""
    master = f"http://{server.host}:{server.ports['master']}"
    began = time.monotonic()
    httpx.get(f"{master}/vol/vacuum", params={"garbageThreshold": "0.0001"}, timeout=timeout)
    return time.monotonic() - began


def size_bytes(directory: str | Path) -> int:
    """Bytes the files under ``directory`` occupy (the store's data on the tmpfs)."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total
