"""Catalog tables, one per module; importing this package registers them all."""

from .agent import AgentRow
from .base import Base, utcnow
from .checkpoint import ENDED_STATES, VALID_STATES, Checkpoint, CheckpointState
from .file import File
from .job import PRIORITY, Job, JobKind, JobState, priority_of
from .peer_copy import PeerCopy, PeerCopyState
from .replica import Replica, ReplicaState
from .run import Run
from .shard import Shard, ShardState

__all__ = [
    "ENDED_STATES",
    "PRIORITY",
    "VALID_STATES",
    "AgentRow",
    "Base",
    "Checkpoint",
    "CheckpointState",
    "File",
    "Job",
    "JobKind",
    "JobState",
    "PeerCopy",
    "PeerCopyState",
    "Replica",
    "ReplicaState",
    "Run",
    "Shard",
    "ShardState",
    "priority_of",
    "utcnow",
]
