"""Objects of POSIX regions, served to restoring clients (with Range).

S3 regions hand out presigned URLs instead; a POSIX region (an NFS mount on
the agent) has no URL of its own, so the agent streams it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header
from fastapi.responses import FileResponse

from ..auth import Action, authorize
from ..deps import PrincipalDep, ResourcesDep
from ..errors import BadInput, NotFound
from ..observability import metrics
from ..storage.posix import PosixStore

router = APIRouter(prefix="/v1/regions", tags=["regions"])


@router.get("/{region}/objects/{key:path}")
async def get_object(
    region: str,
    key: str,
    resources: ResourcesDep,
    principal: PrincipalDep,
    range_header: Annotated[str | None, Header(alias="range")] = None,
) -> FileResponse:
    run = key.split("/", 1)[0]
    authorize(principal, Action.READ, run)
    store = resources.stores.get(region)
    if store is None:
        raise NotFound(f"unknown region {region!r}", code="unknown_region")
    if not isinstance(store, PosixStore):
        raise BadInput(f"region {region!r} is S3; use the presigned URL from the restore plan")
    try:
        path = store.local_path(key)
    except Exception as exc:
        raise BadInput(f"invalid object key {key!r}", code="invalid_key") from exc
    if not path.is_file():
        raise NotFound(f"object {key!r} not found in region {region!r}", code="object_not_found")
    metrics.observe_served(region, range_header, path.stat().st_size)
    return FileResponse(path, media_type="application/octet-stream")
