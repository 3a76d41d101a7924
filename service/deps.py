"""FastAPI dependencies: resources from the lifespan, a request session, the caller."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy.ext.asyncio import AsyncSession

from .auth import Principal, authenticate
from .checkpoints.service import CheckpointService
from .resources import Resources


def get_resources(request: Request) -> Resources:
    resources: Resources = request.app.state.resources
    return resources


ResourcesDep = Annotated[Resources, Depends(get_resources)]


async def get_session(resources: ResourcesDep) -> AsyncIterator[AsyncSession]:
    """One transaction per request: committed on success, rolled back on error."""
    async with resources.sessionmaker() as session:
        try:
            yield session
            await session.commit()
        except BaseException:
            await session.rollback()
            raise


# scope="function": the commit runs before the answer is sent, so a commit
# that fails (catalog gone) is the answer (503), never a 2xx for lost work.
SessionDep = Annotated[AsyncSession, Depends(get_session, scope="function")]


def get_principal(
    resources: ResourcesDep, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    return authenticate(authorization, resources.settings.tokens)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def get_checkpoint_service(session: SessionDep, resources: ResourcesDep) -> CheckpointService:
    return CheckpointService(session, resources)


CheckpointServiceDep = Annotated[CheckpointService, Depends(get_checkpoint_service)]
