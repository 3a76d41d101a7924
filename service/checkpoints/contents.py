"""What a checkpoint consists of in a region: its objects and its manifest.

Commit, replicate and verify jobs all need the same answer, built here from
the catalog so every region gets byte-identical manifests (per key layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ..models import Checkpoint, File, Shard, ShardState
from ..runs.names import name_of_run
from ..storage import chunks, layout
from ..storage.manifest import ObjectEntry, build_manifest


@dataclass(frozen=True)
class Contents:
    run: str
    objects: list[ObjectEntry]  # sha256 "" where the catalog has none yet
    complete: bool  # every rank uploaded and every file hashed

    def manifest(self, checkpoint: Checkpoint, key_layout: str | None = None) -> bytes:
        """The MANIFEST.json of a region whose store has ``key_layout``."""
        return build_manifest(
            run=self.run,
            step=checkpoint.step,
            world_size=checkpoint.world_size,
            epoch=checkpoint.epoch,
            parent={"run": checkpoint.parent_run, "step": checkpoint.parent_step}
            if checkpoint.parent_run is not None
            else None,
            metrics=checkpoint.metrics,
            metadata=checkpoint.meta,
            created_at=checkpoint.created_at,
            files=self.objects,
            key_layout=key_layout,
        )

    def manifest_key(self, checkpoint: Checkpoint) -> str:
        return layout.manifest_key(self.run, checkpoint.step)

    def step_prefix(self, checkpoint: Checkpoint) -> str:
        return layout.step_prefix(self.run, checkpoint.step)


async def load_contents(session: AsyncSession, checkpoint: Checkpoint) -> Contents:
    run = await name_of_run(session, checkpoint.run_id)
    rows = (
        await session.execute(
            select(
                Shard.rank,
                Shard.state,
                File.path,
                File.size,
                File.sha256,
                File.chunk_size,
                File.chunk_sha256,
            )
            .join(File, File.shard_id == Shard.id)
            .where(Shard.checkpoint_id == checkpoint.id)
        )
    ).all()
    complete = len({row.rank for row in rows}) == checkpoint.world_size and all(
        row.state == ShardState.UPLOADED and row.sha256 is not None for row in rows
    )
    objects = [
        ObjectEntry.of(
            run,
            checkpoint.step,
            row.rank,
            row.path,
            row.size,
            row.sha256 or "",
            row.chunk_size,
            None if row.chunk_sha256 is None else chunks.decode(row.chunk_sha256),
        )
        for row in rows
    ]
    return Contents(run=run, objects=objects, complete=complete)
