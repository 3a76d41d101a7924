"""HTTP routes of the peer tier: the agents list, receiving pushed copies,
serving them to restoring clients."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import FileResponse

from ..auth import Action, authorize, authorize_peer_push
from ..db import reading
from ..deps import PrincipalDep, ResourcesDep, SettledRun
from ..errors import NotFound
from ..observability import metrics
from . import agents, layout
from .receive import commit_copy, load_shard, receive_file
from .schemas import AgentList, AgentOut, CommittedCopy, ReceivedFile
from .serve import copy_path

router = APIRouter(prefix="/v1", tags=["peers"], dependencies=[SettledRun])


class _CopyFile(FileResponse):
    # A restore reads whole ranges of large files: larger reads than
    # starlette's 64 KiB mean fewer thread hops and sends per MiB.
    chunk_size = 1024 * 1024


def _served_size(base: Path, target: Path) -> int | None:
    """The file's size, or None: not a file, or a symbolic link leading out
    of the copy (a T0 file replaced after registration) is not served."""
    if not target.is_file() or not target.resolve().is_relative_to(base.resolve()):
        return None
    return target.stat().st_size


@router.get("/agents", response_model=AgentList)
async def list_agents(resources: ResourcesDep, principal: PrincipalDep) -> AgentList:
    """Every agent sharing the catalog, live or not (``[peers] lease_seconds``)."""
    authorize(principal, Action.READ)
    async with reading(resources.read_sessionmaker or resources.sessionmaker)() as session:
        found = await agents.all_agents(session, resources.settings.peers.lease_seconds)
    return AgentList(agents=[AgentOut(**vars(a)) for a in found])


@router.put("/peers/shards/{shard_id}/files/{path:path}", response_model=ReceivedFile)
async def receive_peer_file(
    shard_id: int, path: str, request: Request, resources: ResourcesDep, principal: PrincipalDep
) -> ReceivedFile:
    """One file of a shard pushed by its node's agent (a `peer` token)."""
    authorize_peer_push(principal)
    size = await receive_file(resources, shard_id, path, request.stream())
    return ReceivedFile(path=path, size=size)


@router.post("/peers/shards/{shard_id}/commit", response_model=CommittedCopy)
async def commit_peer_copy(
    shard_id: int, resources: ResourcesDep, principal: PrincipalDep
) -> CommittedCopy:
    """Every file of the shard arrived: the copy is renamed into place and recorded."""
    authorize_peer_push(principal)
    final = await commit_copy(resources, shard_id)
    return CommittedCopy(shard_id=shard_id, node=resources.settings.server.node, path=str(final))


@router.get("/peers/shards/{shard_id}/files/{path:path}")
async def serve_peer_file(
    shard_id: int,
    path: str,
    resources: ResourcesDep,
    principal: PrincipalDep,
    range_header: Annotated[str | None, Header(alias="range")] = None,
) -> FileResponse:
    """A file of this node's copy of the shard (a peer copy, or its own T0
    copy), to a reader of its run."""
    authorize(principal, Action.READ)  # before the catalog is asked anything
    info = await load_shard(resources, shard_id)
    authorize(principal, Action.READ, info.run)
    if path not in info.files:
        raise NotFound(f"shard {shard_id} has no file {path[:200]!r}", code="file_not_found")
    base = await copy_path(resources, shard_id)
    target = layout.confined(base, path)
    size = await asyncio.to_thread(_served_size, base, target)
    if size is None:
        raise NotFound(f"{path} is missing from this node's copy", code="object_not_found")
    metrics.observe_peer_bytes("served", metrics.served_length(range_header, size))
    return _CopyFile(target, media_type="application/octet-stream")
