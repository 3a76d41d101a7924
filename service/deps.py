"""FastAPI dependencies: resources and the agent from the lifespan, a request
session, the registration writer, the caller."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy.ext.asyncio import AsyncSession

from .agent import AgentProcess
from .auth import Principal, authenticate
from .checkpoints.batching import RegistrationBatcher
from .checkpoints.service import CheckpointService
from .db import reading
from .errors import ApiError
from .names import RUN_NAME, RUN_NAME_RULE
from .resources import Resources

# The dependencies are `async def` although they never await: FastAPI runs a
# plain `def` dependency in a thread, a hop that costs a hot call like `latest`
# a noticeable share of its time.


async def get_resources(request: Request) -> Resources:
    resources: Resources = request.app.state.resources
    return resources


ResourcesDep = Annotated[Resources, Depends(get_resources)]


async def get_agent(request: Request) -> AgentProcess:
    agent: AgentProcess = request.app.state.agent
    return agent


AgentDep = Annotated[AgentProcess, Depends(get_agent)]


async def settle_run(request: Request, agent: AgentDep) -> None:
    """Read your own registrations: a run-scoped route's run has its records
    in this agent's inbox written to the catalog first (checkpoints/inbox.py;
    with nothing pending, the usual case, it costs next to nothing). A
    dependency of the run-scoped routers, and of the checkpoints router's
    routes one by one: not `latest` (durable only) nor the detail, which
    answers from the record when the catalog is late (memory/lookup.py)."""
    run = request.path_params.get("run")
    if run is not None and agent.inbox is not None:
        await agent.inbox.settled(run)


SettledRun = Depends(settle_run)


async def settle_runs(agent: AgentDep) -> None:
    """Read your own registrations in a listing of runs: every run's records
    pending in this agent's inbox are written to the catalog first, so a run
    registered a moment ago is listed (the records pending at the call only:
    a stream of new registrations cannot hold the listing)."""
    if agent.inbox is not None:
        await agent.inbox.settled(None)


SettledRuns = Depends(settle_runs)


async def get_registrations(agent: AgentDep) -> RegistrationBatcher:
    """The agent's registration writer (group commit)."""
    return agent.registrations


RegistrationsDep = Annotated[RegistrationBatcher, Depends(get_registrations)]


async def get_session(request: Request, resources: ResourcesDep) -> AsyncIterator[AsyncSession]:
    """One transaction per request: committed on success, rolled back on error.
    A GET only reads: one snapshot, no write lock taken (see db.reading)."""
    maker = resources.sessionmaker
    if request.method in ("GET", "HEAD"):
        maker = reading(resources.read_sessionmaker or resources.sessionmaker)
    async with maker() as session:
        try:
            yield session
            await session.commit()
        except BaseException:
            await session.rollback()
            raise


# scope="function": the commit runs before the answer is sent, so a commit
# that fails (catalog gone) is the answer (503), never a 2xx for lost work.
SessionDep = Annotated[AsyncSession, Depends(get_session, scope="function")]


async def get_principal(
    request: Request,
    resources: ResourcesDep,
    authorization: Annotated[str | None, Header()] = None,
) -> Principal:
    principal = authenticate(authorization, resources.settings.tokens)
    # Every run-scoped route authenticates, so the run named in its path is
    # checked here once for all of them: none can create, look up or build
    # a key from a name that registration would refuse.
    run = request.path_params.get("run")
    if run is not None and not RUN_NAME.match(run):
        raise ApiError(
            f"run name {run[:140]!r} is invalid: {RUN_NAME_RULE}",
            code="invalid_run",
            status=422,
        )
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def get_checkpoint_service(session: SessionDep, resources: ResourcesDep) -> CheckpointService:
    return CheckpointService(session, resources)


CheckpointServiceDep = Annotated[CheckpointService, Depends(get_checkpoint_service)]
