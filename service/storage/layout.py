"""The self-describing object layout, the same in every region.

    {run}/step-{step:012d}/rank-{rank:05d}/{relative/path}
    {run}/step-{step:012d}/MANIFEST.json        # written last: the commit marker

Keys are built only from validated run names, integers and relative paths
that registration already checked; the region's prefix is added by the store.
"""

from __future__ import annotations

MANIFEST_NAME = "MANIFEST.json"


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
