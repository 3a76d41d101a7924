"""``TierckptWriter`` and ``TierckptReader``: see :mod:`tierckpt.client.dcp`.

Imports torch: only reached through ``tierckpt.client.dcp``'s lazy attributes.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import httpx
import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageReaderTransforms
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ._api import auth_headers
from ._dcp_slices import read_slice
from ._download import TransferOptions
from ._verified_ranges import FileCopies, RangeFiles, Remote
from .errors import NotFoundError, RestoreError, TierckptError
from .models import Checkpoint
from .restore import safe_relpath
from .sync_client import CheckpointClient
from .torch.checkpoint_dir import STAGING_PREFIX

log = logging.getLogger("tierckpt.client.dcp")
METADATA = ".metadata"


def _rank_and_world(process_group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    return 0, 1


class TierckptWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` into ``root/run/step-N/rank-R``, each rank's
    directory registered as rank R of the checkpoint once written (the
    coordinator's after ``.metadata``). ``checkpoint``: this rank's
    registration once done. A leftover directory of that step and rank (an
    earlier life that never registered) is replaced; a rank whose part of
    the step is registered already (a step replayed after a resume) writes
    to a throwaway directory instead and leaves the registered files, which
    the agent may still be uploading, alone (DCP's save is collective: every
    rank writes)."""

    def __init__(
        self,
        client: CheckpointClient,
        run: str,
        step: int,
        root: str | os.PathLike[str],
        *,
        process_group: Any = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        parent: int | None = None,
        priority: str = "normal",
        **writer_options: Any,
    ) -> None:
        self.client, self.run, self.step = client, run, step
        # Not self.rank: FileSystemWriter's own attribute, set by DCP.
        self.part_rank, self.world_size = _rank_and_world(process_group)
        self.directory = (
            Path(os.path.abspath(root)) / run / f"step-{step}" / f"rank-{self.part_rank:05d}"
        )
        self._metrics, self._metadata, self._parent = metrics, metadata, parent
        self._priority = priority
        self._coordinator = self.part_rank == 0
        self._began = time.monotonic()
        self.checkpoint: Checkpoint | None = None
        self._scratch: Path | None = None  # set: this rank's part is registered already
        super().__init__(str(self.directory), **writer_options)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        # The directory is this writer's (run, step, rank); a checkpoint_id
        # given to dcp.save cannot move it elsewhere.
        super().reset(None)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._coordinator = is_coordinator
        self._began = time.monotonic()

    def prepare_local_plan(self, plan: Any) -> Any:
        if self._registered_already():
            self.directory.parent.mkdir(parents=True, exist_ok=True)
            self._scratch = Path(
                tempfile.mkdtemp(
                    prefix=f"{STAGING_PREFIX}rank-{self.part_rank:05d}-", dir=self.directory.parent
                )
            )
            self.path = self.fs.init_path(self._scratch)
            log.info(
                "%s step %d rank %d is registered already; not saved again",
                self.run,
                self.step,
                self.part_rank,
            )
        elif self.directory.exists():
            shutil.rmtree(self.directory)
        return super().prepare_local_plan(plan)

    def _registered_already(self) -> bool:
        try:
            detail = self.client.get(self.run, self.step)
        except NotFoundError:
            return False
        return detail.state not in ("failed", "deleted") and any(
            shard.rank == self.part_rank for shard in detail.shards
        )

    def write_data(self, plan: Any, planner: Any) -> Future[Any]:
        written = super().write_data(plan, planner)
        if not self._coordinator:
            written.wait()  # the files are complete and fsynced
            self._register()
        return written

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        super().finish(metadata, results)
        self._register()  # the coordinator's part includes .metadata

    def _register(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            return
        self.checkpoint = self.client.register(
            self.run,
            self.step,
            self.directory,
            rank=self.part_rank,
            world_size=self.world_size,
            metrics=self._metrics,
            metadata=self._metadata,
            parent=self._parent,
            priority=self._priority,
            write_seconds=time.monotonic() - self._began,
        )


def _latest_step(client: CheckpointClient, run: str, region: str | None, process_group: Any) -> int:
    """The latest valid step as rank 0 sees it, the same on every rank."""
    rank, world = _rank_and_world(process_group)
    step: int | str | None = None
    if rank == 0:
        try:
            latest = client.latest(run, region=region)
            step = None if latest is None else latest.step
        except Exception as exc:
            if world == 1:
                raise
            # Every rank waits in the broadcast: they raise too, not hang.
            step = f"rank 0 could not ask for the latest step: {exc}"
    if world > 1:
        box = [step]
        dist.broadcast_object_list(box, group=process_group, group_src=0)
        step = box[0]
    if isinstance(step, str):
        raise TierckptError(step)
    if step is None:
        raise NotFoundError(f"run {run} has no valid checkpoint", code="no_valid_checkpoint")
    return int(step)


class TierckptReader(StorageReader):
    """Loads ``run``'s checkpoint ``step`` (None: the latest valid, agreed by
    every rank of ``process_group``), reading only the verified byte ranges
    this rank's load plan needs. ``root``: where a scratch directory goes
    when a file without chunk hashes must be downloaded whole."""

    def __init__(
        self,
        client: CheckpointClient,
        run: str,
        root: str | os.PathLike[str],
        step: int | None = None,
        *,
        region: str | None = None,
        node: str | None = None,
        process_group: Any = None,
        options: TransferOptions | None = None,
    ) -> None:
        super().__init__()
        from ._node import confirm_node, default_node

        self.client, self.run, self.root = client, run, Path(os.path.abspath(root))
        self.region, self.node = region, node or default_node()
        confirm_node(client, self.node)
        self.step = step if step is not None else _latest_step(client, run, region, process_group)
        self.options = options
        self.storage_data: dict[Any, Any] = {}
        self.load_id = uuid.uuid4().hex
        self.bytes_read = 0
        self.bytes_by_source: dict[str, int] = {}
        self._files: RangeFiles | None = None
        self._transforms = _StorageReaderTransforms()

    # -- StorageReader ----------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex

    @property
    def checkpoint_id(self) -> str:
        return f"tierckpt://{self.run}/{self.step}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # Saved with collectives: there is one .metadata, no rank-local one.
            raise FileNotFoundError("a tierckpt DCP checkpoint has no rank-local metadata")
        files = self._open()
        size = files.files[METADATA].size
        data = files.read(METADATA, 0, size)  # every chunk verified: the whole file is
        self._count()
        # DCP's own format (pickle), read with the trust FileSystemReader gives it,
        # once its bytes are the ones the catalog recorded.
        metadata = cast(Metadata, pickle.loads(data))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise RestoreError("the checkpoint's .metadata has no storage data", code="bad_dcp")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        files = self._open()
        try:
            by_file: dict[str, list[ReadItem]] = {}
            for item in plan.items:
                info: _StorageInfo = self.storage_data[item.storage_index]
                by_file.setdefault(info.relative_path, []).append(item)
            for name, items in by_file.items():
                items.sort(key=lambda i: self.storage_data[i.storage_index].offset)
                for item in items:
                    self._load(files, name, item, planner)
        finally:
            self.close()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def close(self) -> None:
        if self._files is not None:
            self._count()
            self._files.close()
            self._files = None

    # -- internals ---------------------------------------------------------------

    def _count(self) -> None:
        if self._files is not None:
            self.bytes_by_source = dict(self._files.bytes_by_source)
            self.bytes_read = self._files.bytes_read

    def _load(self, files: RangeFiles, name: str, item: ReadItem, planner: LoadPlanner) -> None:
        info: _StorageInfo = self.storage_data[item.storage_index]

        def read(start: int, end: int) -> bytes:
            return files.read(name, info.offset + start, info.offset + end)

        transforms = info.transform_descriptors or ()
        if item.type == LoadItemType.BYTE_IO:
            stream = self._transforms.transform_load_stream(
                item, transforms, io.BytesIO(read(0, info.length))
            )
            planner.load_bytes(item, io.BytesIO(stream.read(-1)))
            return
        tensor = None
        if not transforms:
            tensor = read_slice(read, info.length, item.storage_offsets, item.lengths)
        if tensor is None:
            stream = self._transforms.transform_load_stream(
                item, transforms, io.BytesIO(read(0, info.length))
            )
            whole = torch.load(io.BytesIO(stream.read(-1)), map_location="cpu", weights_only=True)
            tensor = narrow_tensor_by_index(whole, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise RestoreError(
                f"{item.storage_index}: stored slice {tuple(tensor.size())} does not fit "
                f"{tuple(target.size())}",
                code="bad_dcp",
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _open(self) -> RangeFiles:
        """The checkpoint's files and their copies: the restore plan (with
        chunk hashes) for the regions, ``latest?node=`` for this node's T0."""
        if self._files is not None:
            return self._files
        plan = self.client.restore_plan(self.run, self.step, region=self.region, chunks=True)
        local: dict[int, str] = {}
        latest = self.client.latest(self.run, region=self.region, node=self.node)
        if latest is not None and latest.step == self.step and latest.local is not None:
            local = dict(latest.local.ranks)
        files: dict[str, FileCopies] = {}
        token = self.client._token
        for source in plan.sources:
            for f in source.files:
                relative = safe_relpath(f.path)
                copies = files.get(f.path)
                if copies is None:
                    directory = local.get(f.rank)
                    copies = files[f.path] = FileCopies(
                        rank=f.rank,
                        path=f.path,
                        size=f.size,
                        sha256=f.sha256 or "",
                        chunk_size=f.chunk_size,
                        chunk_sha256=f.chunk_sha256,
                        local=None if directory is None else Path(directory) / relative,
                    )
                elif copies.rank != f.rank:
                    raise RestoreError(
                        f"{f.path} is a file of ranks {copies.rank} and {f.rank}: "
                        "not a DCP checkpoint's layout",
                        code="bad_dcp",
                    )
                # The agent's own URLs and peer agents' carry the token;
                # presigned ones must not.
                own = source.tier != "region" or httpx.URL(f.url).is_relative_url
                headers = auth_headers(token) if own else {}
                copies.remotes.append(Remote(source.region, f.url, headers))
        if METADATA not in files:
            raise RestoreError(
                f"{self.run} step {self.step} has no {METADATA}: not a DCP checkpoint",
                code="bad_dcp",
            )
        self._files = RangeFiles(
            files,
            base_url=self.client.base_url,
            timeout=self.client._timeout,
            scratch_root=self.root / self.run,
            options=self.options,
        )
        return self._files
