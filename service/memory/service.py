"""The memory tier of one agent: its arena, the persister, and the answers
about checkpoints held in memory (staged ones, copies, the node's newest).

A checkpoint staged in memory is not in the catalog yet: its registration
is recorded in the segment (arena.py) and reaches the catalog once T0 holds
the bytes (persist.py). Until then this agent answers for it with the state
``staged``; the catalog, and every other agent, does not know it.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator

from ..checkpoints.batching import RegistrationBatcher
from ..checkpoints.presenter import Listing, NewCheckpoint, NewShard, checkpoint_document
from ..checkpoints.scan import check_name, root_of
from ..checkpoints.schemas import MAX_STEP, RegisterRequest, StrictModel
from ..config import Settings
from ..draining import DrainState
from ..errors import BadInput, Conflict
from ..names import RUN_PATTERN, agent_directory_name, not_a_dot_segment
from ..resources import Resources
from .arena import Arena, MemoryFull, Segment
from .persist import SegmentPersister
from .reader import open_data

MAX_FILE_BYTES = 2**50


class SegmentFile(StrictModel):
    path: str = Field(min_length=1, max_length=4096)
    size: int = Field(ge=0, le=MAX_FILE_BYTES)


class ReserveRequest(StrictModel):
    run: str = Field(pattern=RUN_PATTERN)
    step: int = Field(ge=0, le=MAX_STEP)
    rank: int = Field(0, ge=0)
    world_size: int = Field(1, ge=1, le=65536)
    files: list[SegmentFile] = Field(min_length=1, max_length=100_000)

    _run_not_dots = field_validator("run")(not_a_dot_segment)


class SegmentOut(BaseModel):
    id: str
    path: str  # the directory the trainer writes the files into
    bytes: int
    expires_at: str
    # A file the trainer may keep locked (flock) while it holds the segment:
    # once it was and no longer is, the reservation is freed (holder.py).
    holder: str


class StageRequest(RegisterRequest):
    """A segment's registration; with ``reserve_next``, the answer also holds
    a segment of the same files reserved ahead for the run's next save
    (``next_segment``), which that save then writes and stages without a
    reservation call of its own: one call per save instead of two."""

    reserve_next: bool = False


def arena_directory(settings: Settings) -> Path:
    """One directory per agent (names.agent_directory_name)."""
    return Path(settings.memory.dir) / agent_directory_name(
        settings.server.node, settings.catalog.url
    )


def _relative_path(path: str, max_length: int) -> str:
    clean = path.strip("/")
    parts = clean.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise BadInput(
            f"files[].path {path!r} must be relative, without empty, '.' or '..' parts",
            code="invalid_file_name",
        )
    check_name(clean, max_length)
    return clean


class MemoryTier:
    def __init__(
        self, resources: Resources, registrations: RegistrationBatcher, drain: DrainState
    ) -> None:
        settings = resources.settings
        self.settings = settings.memory
        self.local = settings.local
        self.node = settings.server.node
        self.drain = drain
        self.arena = Arena(
            arena_directory(settings), settings.memory.bytes, settings.memory.lease_seconds
        )
        # A staged segment's id -> the one reserved ahead with it: a retried
        # stage (its answer lost) gets the same one back, not a second.
        self._ahead: dict[str, str] = {}
        self.persister = SegmentPersister(
            resources,
            registrations,
            self.arena,
            settings.memory.keep_newest,
            settings.memory.persist_nice,
            settings.worker.cpu_set,
            settings.memory.t0_wait_seconds,
        )

    def open(self) -> None:
        self.arena.open()

    def info(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "node": self.node,
            "bytes": self.arena.budget,
            "used": self.arena.used,
            "when_full": self.settings.when_full,
            "wait_seconds": self.settings.wait_seconds,
            "keep_newest": self.settings.keep_newest,
            # This agent reserves a save's next segment when staging it.
            "reserve_next": True,
            "segments": [s.describe() for s in self.arena.segments.values()],
        }

    # -- the trainer's calls -------------------------------------------------------------

    def reserve(self, request: ReserveRequest) -> SegmentOut:
        if request.rank >= request.world_size:
            raise BadInput(
                f"rank {request.rank} must be below world_size {request.world_size}",
                code="invalid_request",
            )
        if len(request.files) > self.local.max_files_per_checkpoint:
            raise BadInput(
                f"at most {self.local.max_files_per_checkpoint} files per checkpoint",
                code="too_many_files",
            )
        files: dict[str, int] = {}
        for entry in request.files:
            path = _relative_path(entry.path, self.local.max_path_length)
            if path in files:
                raise BadInput(f"files[].path {path!r} is listed twice", code="invalid_file_name")
            files[path] = entry.size
        directories = {
            "/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)
        }
        if clash := sorted(directories & files.keys()):
            raise BadInput(
                f"files[].path {clash[0]!r} is both a file and a directory",
                code="invalid_file_name",
            )
        self._refuse_taken_step(request.run, request.rank, request.step)
        try:
            segment = self.arena.reserve(
                request.run, request.step, request.rank, request.world_size, files
            )
        except MemoryFull as exc:
            if exc.code != "segment_too_large":  # room frees once T0 holds what waits
                self.persister.press()
            raise
        except OSError as exc:  # the arena's file system refused (full, gone)
            raise MemoryFull(
                f"the memory tier could not create the segment ({exc.strerror}); "
                "the checkpoint goes to T0",
            ) from exc
        return _segment_out(segment)

    def stage(self, segment_id: str, request: StageRequest) -> dict[str, Any]:
        """Record the registration of a complete segment; the agent takes it
        to T0 and the catalog from here. Returns the staged checkpoint (with
        ``next_segment`` when asked: None when the arena has no room for it
        without evicting a checkpoint's copy)."""
        segment = self.arena.get(segment_id)
        ahead = segment.step is None
        if (segment.run, segment.rank, segment.world_size) != (
            request.run,
            request.rank,
            request.world_size,
        ) or (not ahead and segment.step != request.step):
            step = "its next save" if ahead else f"step {segment.step}"
            raise BadInput(
                f"segment {segment_id} was reserved for {segment.run} {step} "
                f"rank {segment.rank}/{segment.world_size}; register that",
                code="segment_mismatch",
            )
        if request.files:
            raise BadInput(
                "files[] hashes are not taken with a memory segment", code="invalid_request"
            )
        self._check_target(request.path)
        if ahead:
            self._refuse_taken_step(request.run, request.rank, request.step)
        if segment.registration is None:
            self.drain.admit(request.priority)
            if ahead:  # complete, with the sizes written, and its step recorded
                self.arena.adopt(segment, request.step)
            else:
                self.arena.check_complete(segment)
        registration = request.model_dump(mode="json", exclude_none=True, exclude={"reserve_next"})
        self.arena.stage(segment, registration)
        self.persister.wake()
        document = self.staged_document(request.run, [segment])
        if request.reserve_next:
            # Draining, the agent takes no next save: nothing reserved for one.
            document["next_segment"] = None if self.drain.active else self._reserve_ahead(segment)
        return document

    def _refuse_taken_step(self, run: str, rank: int, step: int) -> None:
        """One segment per run, rank and step being staged: checked when a
        segment is reserved, and when one reserved ahead gets its step."""
        if any(
            s.rank == rank and s.step == step
            for s in self.arena.of_run(run, ("reserved", "staged"))
        ):
            raise Conflict(
                f"{run} step {step} rank {rank} is being staged in memory already",
                code="segment_exists",
            )

    def _reserve_ahead(self, staged: Segment) -> dict[str, Any] | None:
        """A segment of ``staged``'s files for its run's next save, or None.
        Only from free room: it never evicts a checkpoint's copy
        (nor makes a save wait), and a reservation that is not staged within
        the lease is reclaimed as any other."""
        earlier = self.arena.segments.get(self._ahead.get(staged.id, ""))
        if earlier is not None and earlier.state == "reserved" and earlier.step is None:
            return _segment_out(earlier).model_dump()
        self._ahead = {k: v for k, v in self._ahead.items() if v in self.arena.segments}
        try:
            segment = self.arena.reserve(
                staged.run, None, staged.rank, staged.world_size, dict(staged.files), evict=False
            )
        except (MemoryFull, OSError):
            return None
        self._ahead[staged.id] = segment.id
        return _segment_out(segment).model_dump()

    def _check_target(self, path: str) -> None:
        """The T0 path: absolute, under a configured root (the confinement of
        registration), and not a symlink (the agent writes there)."""
        target = Path(path)
        if not target.is_absolute() or ".." in target.parts:
            raise BadInput(
                f"path {path!r} must be absolute, without '..'", code="path_outside_roots"
            )
        if target.is_symlink():
            raise BadInput(f"path {path!r} is a symlink", code="path_outside_roots")
        existing = target.parent
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        resolved = Path(os.path.realpath(existing))
        if root_of(resolved, self.local.roots) is None:
            roots = ", ".join(str(r) for r in self.local.roots)
            raise BadInput(
                f"path {path!r} is outside the configured local roots ({roots})",
                code="path_outside_roots",
            )

    def open_file(self, shard_path: Path, relative: str) -> int | None:
        """The memory copy of a registered T0 file, open for reading, or
        None. Called from upload threads: reads a snapshot of the segments."""
        target = str(shard_path)
        for segment in list(self.arena.segments.values()):
            registration = segment.registration or {}
            if (
                registration.get("path") != target
                or segment.state not in ("staged", "persisted")
                or relative not in segment.files
            ):
                continue
            return open_data(segment.data, relative)
        return None

    def release(self, segment_id: str) -> None:
        segment = self.arena.get(segment_id)
        if segment.state == "staged":
            raise Conflict(
                f"segment {segment_id} is registered; the agent frees it once T0 holds it",
                code="segment_registered",
            )
        self.arena.release(segment_id)

    # -- answers -------------------------------------------------------------------------

    def staged_document(self, run: str, segments: list[Segment]) -> dict[str, Any]:
        """The checkpoint of staged (or failed) segments as a CheckpointOut
        document, state ``staged`` (``failed`` when the agent could not
        register it)."""
        first = segments[0]
        body = RegisterRequest.model_validate(first.registration)
        failed = next((s.failed for s in segments if s.failed is not None), None)
        checkpoint = NewCheckpoint(
            step=body.step,
            state="failed" if failed else "staged",
            world_size=first.world_size,
            epoch=body.epoch,
            priority=body.priority,
            metrics=body.metrics,
            meta=body.metadata,
            parent_run=body.parent.run if body.parent else None,
            parent_step=body.parent.step if body.parent else None,
            created_at=datetime.fromtimestamp(first.created, UTC).replace(tzinfo=None),
            total_bytes=sum(s.nbytes for s in segments),
            file_count=sum(len(s.files) for s in segments),
            write_seconds=body.write_seconds,
            error=failed,
        )
        shards = [
            NewShard(
                rank=s.rank,
                node=self.node,
                path=(s.registration or {}).get("path", ""),
                state=s.state,
                error=s.failed,
            )
            for s in sorted(segments, key=lambda s: s.rank)
        ]
        document = checkpoint_document(run, checkpoint, Listing(shards=shards, replicas=[]))
        document["copies"] = self.memory_copies(segments)
        return document

    def memory_copies(self, segments: list[Segment]) -> list[dict[str, Any]]:
        return [
            {
                "tier": "memory",
                "node": self.node,
                "rank": s.rank,
                "path": str(s.data),
                "region": None,
                "uri": None,
            }
            for s in sorted(segments, key=lambda s: s.rank)
        ]

    def held(self, run: str, step: int | None = None) -> list[Segment]:
        """Segments of ``run`` (at ``step``) whose bytes are whole in memory."""
        return [
            s
            for s in self.arena.of_run(run, ("staged", "persisted", "failed"))
            if step is None or s.step == step
        ]

    def staged_of(self, run: str, step: int) -> list[Segment]:
        return [s for s in self.arena.of_run(run, ("staged", "failed")) if s.step == step]


def _segment_out(segment: Segment) -> SegmentOut:
    return SegmentOut(
        id=segment.id,
        path=str(segment.data),
        bytes=segment.nbytes,
        expires_at=_iso(segment.lease_until),
        holder=str(segment.holder),
    )


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
