"""Python client of tierckpt: register checkpoints, ask for the latest valid
one, wait for durability and restore verified copies.

Deliberately light: importing it pulls in httpx, pydantic and (for the CLI)
rich, never the service's dependencies.
"""

from ._download import TransferOptions
from .async_client import AsyncCheckpointClient
from .errors import (
    AuthError,
    BadRequestError,
    CheckpointFailedError,
    ConflictError,
    DestinationError,
    NotFoundError,
    RestoreError,
    ServerError,
    TierckptError,
)
from .models import (
    Checkpoint,
    CheckpointRef,
    FileEntry,
    LocalCopy,
    Location,
    Prefetch,
    PrefetchJob,
    Replica,
    RestorePlan,
    RunSummary,
    Shard,
)
from .sync_client import CheckpointClient

__all__ = [
    "AsyncCheckpointClient",
    "AuthError",
    "BadRequestError",
    "Checkpoint",
    "CheckpointClient",
    "CheckpointFailedError",
    "CheckpointRef",
    "ConflictError",
    "DestinationError",
    "FileEntry",
    "LocalCopy",
    "Location",
    "NotFoundError",
    "Prefetch",
    "PrefetchJob",
    "Replica",
    "RestoreError",
    "RestorePlan",
    "RunSummary",
    "ServerError",
    "Shard",
    "TierckptError",
    "TransferOptions",
]
