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
from .service import object_file

router = APIRouter(prefix="/v1/regions", tags=["regions"])


@router.get("/{region}/objects/{key:path}")
async def get_object(
    region: str,
    key: str,
    resources: ResourcesDep,
    principal: PrincipalDep,
    range_header: Annotated[str | None, Header(alias="range")] = None,
) -> FileResponse:
    authorize(principal, Action.READ, key.split("/", 1)[0])
    path = await object_file(resources.stores, region, key, range_header)
    return FileResponse(path, media_type="application/octet-stream")
