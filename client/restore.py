"""Turn a restore plan into a verified local directory, all or nothing (or
copy one from this node's intact T0 copies, verified the same way).

Files are staged in a hidden directory next to ``dest`` (same filesystem),
each one SHA-256 verified, fsynced, and the directory renamed onto ``dest``
only when every file is good. A source (region) that fails or serves bad
bytes is abandoned for the next one; files already verified are kept, so a
fallback only re-fetches what is missing. Any failure removes the staging
directory: a failed restore leaves nothing half-written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import httpx

from ._api import auth_headers
from ._direct_get import DirectRanges
from ._download import FileJob, SourceError, TransferOptions, fetch_files, in_thread
from ._files import fsync_dir
from .errors import BadRequestError, DestinationError, RestoreError
from .models import Checkpoint, PlanFile, RestorePlan

log = logging.getLogger("tierckpt.client.restore")

Progress = Callable[[int, int], None]
PARTIAL_INFIX = ".tierckpt-partial-"
LOCAL_PIECE = 8 << 20  # what a copy from a local T0 copy holds at once


def safe_relpath(path: str) -> PurePosixPath:
    """The plan path as a relative path confined to the destination."""
    if not path or "\x00" in path or "\\" in path:
        raise RestoreError(f"refusing unsafe path {path!r} in the restore plan", code="unsafe_path")
    rel = PurePosixPath(path)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise RestoreError(f"refusing unsafe path {path!r} in the restore plan", code="unsafe_path")
    return rel


def plan_layout(files: list[PlanFile], rank: int | None) -> list[tuple[PlanFile, PurePosixPath]]:
    """Where each file of one source lands, relative to ``dest``.

    One rank, or ranks whose paths never collide (the usual sharded layout
    with rank in the file name), restore flat; otherwise every rank gets its
    own ``rank-NNNNN/`` directory, mirroring the object layout.
    """
    if rank is not None:
        files = [f for f in files if f.rank == rank]
    rels = [safe_relpath(f.path) for f in files]
    if rank is None and len(set(rels)) != len(rels):
        rels = [
            PurePosixPath(f"rank-{f.rank:05d}") / rel for f, rel in zip(files, rels, strict=True)
        ]
    seen: set[PurePosixPath] = set()
    for rel in rels:
        if rel in seen:
            raise RestoreError(f"the restore plan lists {rel} twice", code="duplicate_path")
        seen.add(rel)
    directories = {parent for rel in rels for parent in rel.parents}
    clash = seen & directories
    if clash:
        raise RestoreError(
            f"the restore plan uses {sorted(clash)[0]} as both a file and a directory",
            code="duplicate_path",
        )
    for f in files:
        if not f.sha256:
            raise RestoreError(
                f"the restore plan has no SHA-256 for {f.path}; refusing unverifiable data",
                code="unverifiable",
            )
    return list(zip(files, rels, strict=True))


def check_destination(dest: str | os.PathLike[str]) -> Path:
    """``dest`` as an absolute path that may be restored to: absent, or an
    empty directory (replaced by the rename)."""
    path = Path(os.path.abspath(dest))
    try:
        _check_destination(path)
    except OSError as exc:
        message = f"cannot use {path}: {exc.strerror or exc}"
        raise DestinationError(message, code="dest_unusable") from exc
    return path


def _check_destination(path: Path) -> None:
    if path.is_symlink():
        raise DestinationError(
            f"{path} is a symbolic link; give a new directory", code="dest_exists"
        )
    if path.exists():
        if not path.is_dir():
            raise DestinationError(f"{path} exists and is not a directory", code="dest_exists")
        if any(path.iterdir()):
            raise DestinationError(
                f"{path} is not empty; restore into a new or empty directory", code="dest_not_empty"
            )


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_free_space(target: Path, sizes: list[int], name: str) -> None:
    """Refuse a restore the destination's filesystem cannot hold (data blocks
    only; a filesystem that cannot say is not checked)."""
    where = _existing_ancestor(target.parent)
    try:
        info = os.statvfs(where)
    except OSError:
        return
    block = info.f_frsize or 4096
    needed = sum(-(-size // block) * block for size in sizes)
    free = info.f_bavail * block
    if needed > free:
        raise DestinationError(
            f"not enough space to restore {name}: it needs {needed} bytes, {where} has {free} "
            "free; free some space or restore elsewhere",
            code="no_space",
        )


def _local_error(exc: OSError, doing: str) -> RestoreError:
    """A local write failure as the client's error; the caller has not left
    anything behind (the staging directory goes in the finally)."""
    if exc.errno in NO_SPACE:
        # Raced the free-space check (or quota): the user's disk, not the service.
        return DestinationError(
            f"{doing} failed: no space left on the device ({exc.strerror}); free some space "
            "or restore elsewhere",
            code="no_space",
        )
    return RestoreError(f"{doing} failed: {exc}", code="local_io_error")


def _default_dir_mode() -> int:
    # mkdtemp makes 0700 directories; the restored one should look like any
    # directory the user creates. Reading the umask via os.umask would race
    # with other threads, so ask /proc.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o777 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o755


def _commit(staging: Path, dest: Path) -> None:
    mode = dest.stat().st_mode & 0o7777 if dest.is_dir() else _default_dir_mode()
    for directory, _dirs, _files in os.walk(staging, topdown=False):
        fsync_dir(directory)
    os.chmod(staging, mode)
    try:
        os.rename(staging, dest)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise DestinationError(
                f"{dest} appeared or changed during the restore: {exc.strerror}",
                code="dest_not_empty",
            ) from exc
        raise
    fsync_dir(dest.parent)


Staged = dict[PurePosixPath, tuple[int, str] | None]


def _staging_next_to(target: Path) -> tuple[Path, list[Path]]:
    """``_make_staging``, its failure said as the destination's fault."""
    try:
        return _make_staging(target)
    except OSError as exc:
        raise DestinationError(
            f"cannot create a staging directory next to {target}: {exc.strerror or exc}",
            code="dest_unusable",
        ) from exc


def _make_staging(target: Path) -> tuple[Path, list[Path]]:
    """The staging directory, and the parents of ``dest`` created for it
    (deepest first), so a failed restore can take those away too."""
    created = []
    parent = target.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{target.name}{PARTIAL_INFIX}", dir=target.parent)
    return Path(staging), created


def _discard(staging: Path, created_parents: list[Path]) -> None:
    # After a successful rename the staging path no longer exists.
    if not staging.exists():
        return
    shutil.rmtree(staging, ignore_errors=True)
    for parent in created_parents:
        try:
            parent.rmdir()
        except OSError:
            break


def _prune(staging: Path, staged: Staged, wanted: dict[PurePosixPath, tuple[int, str]]) -> None:
    """Drop what the next source will not reuse: partial files, and verified
    files this source describes differently (or not at all)."""
    removed = False
    for rel, state in list(staged.items()):
        if state is None or wanted.get(rel) != state:
            (staging / rel).unlink(missing_ok=True)
            del staged[rel]
            removed = True
    if removed:
        for directory, _dirs, _files in os.walk(staging, topdown=False):
            if directory != str(staging) and not os.listdir(directory):
                os.rmdir(directory)


class _Meter:
    """Bytes done out of the current source's total, for the progress callback."""

    def __init__(self, callback: Progress | None, done: int, total: int):
        self.callback, self.done, self.total = callback, done, total
        self.add(0)

    def add(self, count: int) -> None:
        self.done += count
        if self.callback is not None:
            self.callback(self.done, self.total)


def _jobs(
    staging: Path,
    layout: list[tuple[PlanFile, PurePosixPath]],
    staged: Staged,
    token: str | None,
    peer: bool = False,
) -> list[FileJob]:
    jobs = []
    for f, rel in layout:
        if rel in staged:
            continue
        staged[rel] = None
        # Relative URLs are the service's own object endpoint and need the
        # token, as do peer agents' URLs; other absolute ones are presigned
        # and must not carry it.
        relative = peer or httpx.URL(f.url).is_relative_url
        jobs.append(
            FileJob(
                url=f.url,
                target=staging / rel,
                size=f.size,
                sha256=f.sha256 or "",
                label=f"rank {f.rank} {f.path}",
                headers=auth_headers(token) if relative else {},
            )
        )
    return jobs


def _direct_reader(
    http: httpx.AsyncClient, direct: bool
) -> contextlib.AbstractAsyncContextManager[DirectRanges | None]:
    if not direct:
        return contextlib.nullcontext()
    timeout = http.timeout
    return DirectRanges(connect_timeout=timeout.connect, read_timeout=timeout.read)


async def restore_from_plan(
    plan: RestorePlan,
    dest: str | os.PathLike[str],
    *,
    http: httpx.AsyncClient,
    token: str | None,
    rank: int | None = None,
    progress: Progress | None = None,
    options: TransferOptions | None = None,
    direct: bool = False,
) -> Path:
    """Download ``plan`` into ``dest`` and return ``dest`` once verified.

    With ``direct``, presigned URLs are read by :class:`DirectRanges`
    (received straight into the range buffers) instead of ``http``, which
    still serves relative URLs and what the direct reader cannot handle;
    callers that gave ``http`` a transport of their own leave it off."""
    options = options or TransferOptions()
    target = check_destination(dest)
    name = f"{plan.run}:{plan.step}"
    if rank is not None and not 0 <= rank < plan.world_size:
        raise BadRequestError(
            f"rank {rank} is outside world size {plan.world_size} of {name}", code="invalid_rank"
        )
    if not plan.sources:
        raise RestoreError(f"no region holds a committed copy of {name}", code="no_source")
    # Refuse a bad plan before writing a single byte.
    layouts = [plan_layout(source.files, rank) for source in plan.sources]
    # ...and a destination that cannot hold it: better now than at 90 %.
    await in_thread(check_free_space, target, [f.size for f, _ in layouts[0]], name)

    staging, created_parents = _staging_next_to(target)
    # Relative path -> (size, sha256) once verified, None while partial.
    staged: Staged = {}
    failures: list[str] = []

    def on_verified(job: FileJob) -> None:
        staged[PurePosixPath(job.target.relative_to(staging))] = (job.size, job.sha256)

    try:
        for number, (source, layout) in enumerate(zip(plan.sources, layouts, strict=True)):
            wanted = {rel: (f.size, f.sha256 or "") for f, rel in layout}
            await in_thread(_prune, staging, staged, wanted)
            reused = sum(f.size for f, rel in layout if rel in staged)
            meter = _Meter(progress, reused, sum(f.size for f, _ in layout))
            jobs = _jobs(staging, layout, staged, token, source.tier != "region")
            try:
                async with _direct_reader(http, direct) as reader:
                    await fetch_files(
                        http,
                        jobs,
                        options=options,
                        on_bytes=meter.add,
                        on_verified=on_verified,
                        direct=reader,
                    )
            except SourceError as exc:
                failures.append(f"{source.region}: {exc}")
                rest = [s.region for s in plan.sources[number + 1 :]]
                then = f"; trying {rest[0]}" if rest else ""
                log.warning("restore of %s from %s failed (%s)%s", name, source.region, exc, then)
                continue
            except OSError as exc:
                raise _local_error(
                    exc, f"writing the restore of {name} under {target.parent}"
                ) from exc
            if number:
                log.warning("restored %s from fallback region %s", name, source.region)
            try:
                await in_thread(_commit, staging, target)
            except OSError as exc:
                raise _local_error(exc, f"finishing the restore into {target}") from exc
            return target
        raise RestoreError(
            f"could not restore {name} from any region: " + "; ".join(failures),
            code="all_sources_failed",
        )
    finally:
        await in_thread(_discard, staging, created_parents)


def restore_from_local(
    checkpoint: Checkpoint,
    dest: str | os.PathLike[str],
    *,
    rank: int | None = None,
    progress: Progress | None = None,
) -> Path | None:
    """Copy ``checkpoint`` (all ranks, or ``rank``'s) from this node's intact
    T0 copies (``checkpoint.local``: the node's own, or prefetched ones) into
    ``dest``, every file SHA-256 verified while copied, staged and renamed
    like a download; None, leaving nothing behind, when a rank is not there or
    a file does not hash right: the caller downloads instead. Blocking."""
    local = checkpoint.local
    name = f"{checkpoint.run}:{checkpoint.step}"
    if local is None:
        return None
    files = [
        PlanFile(rank=f.rank, path=f.path, size=f.size, sha256=f.sha256, url="")
        for f in checkpoint.files
    ]
    layout = plan_layout(files, rank)
    sources: dict[int, Path] = {}
    for f, _rel in layout:
        directory = local.of_rank(f.rank)
        if directory is None:
            return None
        sources[f.rank] = Path(directory)
    target = check_destination(dest)
    check_free_space(target, [f.size for f, _ in layout], name)
    staging, created_parents = _staging_next_to(target)
    meter = _Meter(progress, 0, sum(f.size for f, _ in layout))
    try:
        for f, rel in layout:
            source = sources[f.rank] / safe_relpath(f.path)
            if not _copy_verified(source, staging / rel, f.size, f.sha256 or "", meter):
                log.warning("local copy %s of %s does not hash right; downloading", source, name)
                return None
        try:
            _commit(staging, target)
        except OSError as exc:
            raise _local_error(exc, f"finishing the restore into {target}") from exc
        return target
    except OSError as exc:
        raise _local_error(exc, f"copying the local copy of {name} into {target.parent}") from exc
    finally:
        _discard(staging, created_parents)


def _copy_verified(source: Path, target: Path, size: int, sha256: str, meter: _Meter) -> bool:
    """Copy ``source`` to ``target`` (fsynced), hashing the bytes copied;
    whether they are ``size`` bytes hashing to ``sha256``. A source that
    cannot be read (gone, not this machine's, unreadable) is False too; a
    failure to write ``target`` raises."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    seen = 0
    try:
        reader = open(source, "rb")
    except OSError:
        return False
    with reader, open(target, "wb") as writer:
        while True:
            try:
                piece = reader.read(LOCAL_PIECE)
            except OSError:
                return False
            if not piece:
                break
            seen += len(piece)
            if seen > size:
                return False  # not the file the catalog describes: stop reading it
            digest.update(piece)
            writer.write(piece)
            meter.add(len(piece))
        writer.flush()
        os.fsync(writer.fileno())
    return seen == size and digest.hexdigest() == sha256
