"""What the framework integrations share (:mod:`.lightning`, :mod:`.hf`),
without importing any framework: finding this node's verified copy of a
checkpoint, and bringing a verified copy into place all or nothing.

"Verified" always means one of two things here: the agent vouched for the
node's T0 copy (``latest(..., node=)`` answers ``local`` only when every file
still has the size and mtime it had when it was uploaded and hashed), or this
module hashed the files itself against the catalog's SHA-256. Anything else is
downloaded through the client's restore, which hashes every byte it writes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from ._files import fsync_dir
from .errors import NotFoundError
from .models import Checkpoint
from .sync_client import CheckpointClient

log = logging.getLogger("tierckpt.client.frameworks")

VALID_STATES = frozenset({"durable", "replicated"})
STAGING_PREFIX = ".tierckpt-staging-"
RESTORE_PREFIX = ".tierckpt-restore-"
_OWNER = re.compile(r"-pid(\d+)-")


def scratch_dir(prefix: str, directory: Path) -> Path:
    """A new hidden directory in ``directory`` whose name carries this
    process's id, so that :func:`remove_leftovers` leaves it alone while the
    process lives (the ranks of a job start at different times, and one
    rank's start must not remove another's save or restore in progress)."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}pid{os.getpid()}-", dir=directory))


def remove_leftovers(directory: Path, prefixes: tuple[str, ...]) -> int:
    """Remove the scratch directories (:func:`scratch_dir`) in ``directory``
    of processes that are gone: saves or restores killed midway, never
    registered, never complete. ``directory`` is node-local, so a process id
    names a process of this node. Returns how many went."""
    removed = 0
    if not directory.is_dir():
        return 0
    for entry in directory.iterdir():
        if not entry.name.startswith(prefixes) or not entry.is_dir():
            continue
        owner = _OWNER.search(entry.name)
        if owner is not None and _alive(int(owner.group(1))):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def matches_catalog(directory: Path, checkpoint: Checkpoint, *, hash_files: bool = True) -> bool:
    """Whether ``directory`` holds exactly the files the catalog lists for
    ``checkpoint`` (rank 0), each with its size and, with ``hash_files``, its
    SHA-256. Extra files are allowed (a trainer's own leftovers do not make a
    checkpoint invalid, and are never loaded by name)."""
    files = [f for f in checkpoint.files if f.rank == 0]
    if not files:
        return False
    for entry in files:
        path = directory / entry.path
        try:
            if not path.is_file() or path.stat().st_size != entry.size:
                return False
            if hash_files and (entry.sha256 is None or sha256_of(path) != entry.sha256):
                return False
        except OSError:
            return False
    return True


def resolve_step(client: CheckpointClient, run: str, step: int | None, node: str) -> Checkpoint:
    """The checkpoint to load: the latest valid one (``step`` None, with the
    agent's answer about this node's T0 copy) or the given step, which must be
    valid (durable or replicated): an unfinished, failed or corrupt one is
    refused by name instead of being loaded."""
    if step is None:
        latest = client.latest(run, node=node)
        if latest is None:
            raise NotFoundError(
                f"run {run!r} has no valid checkpoint yet", code="no_valid_checkpoint"
            )
        return latest
    checkpoint = client.get(run, step)
    if checkpoint.state not in VALID_STATES:
        raise NotFoundError(
            f"checkpoint {run}:{step} is {checkpoint.state}, not durable: refusing to load it"
            + (f" ({checkpoint.error})" if checkpoint.error else ""),
            code="not_valid",
        )
    return checkpoint


def local_copy(checkpoint: Checkpoint, node: str) -> Path | None:
    """This node's verified T0 copy of ``checkpoint``, if any: the agent's word
    for a ``latest`` answer, the files hashed against the catalog otherwise."""
    if checkpoint.world_size != 1:
        return None
    if checkpoint.local is not None:
        path = checkpoint.local.of_rank(0) if checkpoint.local.node == node else None
        return Path(path) if path is not None else None
    for shard in checkpoint.shards:
        if shard.rank == 0 and shard.node == node and shard.path:
            directory = Path(shard.path)
            if matches_catalog(directory, checkpoint):
                return directory
    return None


def place_verified(
    client: CheckpointClient,
    checkpoint: Checkpoint,
    dest: Path,
    *,
    node: str,
    from_local: bool = True,
) -> tuple[Path, str]:
    """Make ``dest`` (which must not exist) a verified copy of ``checkpoint``;
    returns (``dest``, "local" or "region").

    From this node's T0 copy the files are copied (in the kernel: a reflink
    where the filesystem has them) into a hidden sibling of ``dest``, hashed
    against the catalog and renamed into place. Copied, not hard-linked:
    ``dest`` is the trainer's (a framework may load it mapped, or write
    into it), and a shared inode would tie the agent's copy and the
    trainer's files together for as long as either lives; otherwise, or when that copy does not
    hash right, the client restores from a region (verified, staged, renamed).
    Either way ``dest`` appears whole or not at all."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    source = local_copy(checkpoint, node) if from_local else None
    if source is not None:
        staging = scratch_dir(f"{RESTORE_PREFIX}{dest.name}-", dest.parent)
        try:
            for entry in checkpoint.files:
                target = staging / entry.path
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source / entry.path, target)
            if matches_catalog(staging, checkpoint):
                staging.chmod(0o755)
                os.rename(staging, dest)
                fsync_dir(dest.parent)
                return dest, "local"
            log.warning(
                "local copy %s does not hash to the catalog; restoring from a region", source
            )
        except OSError as exc:
            log.warning("local copy %s unusable (%s); restoring from a region", source, exc)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    client.restore(checkpoint.run, dest, step=checkpoint.step)
    return dest, "region"


def link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        # Another filesystem (EXDEV) or one without hard links: pay a copy.
        shutil.copy2(source, target)
