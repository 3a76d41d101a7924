"""The self-describing object layout, the same in every region.

    {run}/step-{step:012d}/rank-{rank:05d}/{relative/path}
    {run}/step-{step:012d}/MANIFEST.json        # written last: the commit marker

Keys are built only from validated run names, integers and relative paths
that registration already checked; the region's prefix is added by the store.

An S3 region with ``hashed_prefix`` stores each object key under a partition
segment first, four hex digits of the SHA-256 of its run, step and rank
(``3fa2/{run}/step-…/rank-…/…``): S3 scales request rates per key prefix, and
the ranks of one checkpoint otherwise all write under one. Manifests are not
moved (one per checkpoint, written once), and a store maps the keys it lists
back (``unhashed``), so everything above the store sees the layout above.
"""

from __future__ import annotations

import hashlib

MANIFEST_NAME = "MANIFEST.json"
# What a MANIFEST.json written into a hashed region says (``key_layout``).
HASHED_LAYOUT = "hashed-prefix/1"
PARTITION_HEX = 4


def step_prefix(run: str, step: int) -> str:
    return f"{run}/step-{step:012d}/"


def shard_prefix(run: str, step: int, rank: int) -> str:
    return f"{step_prefix(run, step)}rank-{rank:05d}/"


def object_key(run: str, step: int, rank: int, relative_path: str) -> str:
    return f"{shard_prefix(run, step, rank)}{relative_path}"


def manifest_key(run: str, step: int) -> str:
    return f"{step_prefix(run, step)}{MANIFEST_NAME}"


def rank_and_path(key: str) -> tuple[int, str]:
    """The rank and relative path an ``object_key`` was built from (run names
    hold no ``/``, so the first three parts are run, step and rank)."""
    _run, _step, rank, relative_path = key.split("/", 3)
    return int(rank.removeprefix("rank-")), relative_path


def partition(key: str) -> str | None:
    """The partition segment of an object key (run/step/rank/path, or the
    prefix of a rank's objects); None for other keys (manifests, step prefixes)."""
    parts = key.split("/", 3)
    if len(parts) < 4 or not parts[2].startswith("rank-"):
        return None
    return hashlib.sha256("/".join(parts[:3]).encode()).hexdigest()[:PARTITION_HEX]


def hashed(key: str) -> str:
    """``key`` as a hashed region stores it."""
    segment = partition(key)
    return f"{segment}/{key}" if segment else key


def unhashed(stored: str) -> str:
    """The key ``hashed`` made ``stored`` from: its first segment goes only
    when it is the partition of the rest (a run named like a hash stays)."""
    head, _, rest = stored.partition("/")
    return rest if rest and partition(rest) == head else stored
