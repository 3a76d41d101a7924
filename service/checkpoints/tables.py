"""The catalog tables the registration writer's Core statements use
(batch_write.py, fresh_batch.py)."""

from __future__ import annotations

from typing import cast

from sqlalchemy import Table

from ..models import Checkpoint, File, Job, Replica, Run, Shard

CHECKPOINTS = cast(Table, Checkpoint.__table__)
SHARDS = cast(Table, Shard.__table__)
FILES = cast(Table, File.__table__)
REPLICAS = cast(Table, Replica.__table__)
RUNS = cast(Table, Run.__table__)
JOBS = cast(Table, Job.__table__)
