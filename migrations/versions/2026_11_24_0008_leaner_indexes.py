"""leaner indexes: drop those a unique index already leads with; the hash
and parent indexes hold only rows that have one

Every index is one more B-tree page a registration writes (and on SQLite
fsyncs through the WAL): a tiny checkpoint's registration wrote 18 pages.
``files(shard_id)``, ``shards(checkpoint_id)``, ``replicas(checkpoint_id)``
and ``peer_copies(shard_id)`` are each the first column of a unique index
of their table, which answers the same lookups. ``files.sha256`` is NULL
until the upload hashes the file and ``checkpoints.parent_*`` is NULL for a
checkpoint without a parent; every query of either index compares with
``=``, which excludes NULL, so the indexes need not hold those rows.

Revision ID: 2026_11_24_0008
Revises: 2026_11_24_0007_peer_tier
Create Date: 2026-11-24 19:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2026_11_24_0008"
down_revision: str | None = "2026_11_24_0007_peer_tier"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (table, index, columns) led by a unique index of the same table.
REDUNDANT = (
    ("files", "ix_files_shard_id", ["shard_id"]),
    ("shards", "ix_shards_checkpoint_id", ["checkpoint_id"]),
    ("replicas", "ix_replicas_checkpoint_id", ["checkpoint_id"]),
    ("peer_copies", "ix_peer_copies_shard_id", ["shard_id"]),
)
# (table, index, columns, the column that is NULL in the rows left out).
PARTIAL = (
    ("files", "ix_files_sha256", ["sha256"], "sha256"),
    ("checkpoints", "ix_checkpoints_parent", ["parent_run", "parent_step"], "parent_run"),
)


def _where(column: str) -> dict[str, sa.TextClause]:
    condition = sa.text(f"{column} IS NOT NULL")
    return {"sqlite_where": condition, "postgresql_where": condition}


def upgrade() -> None:
    for table, index, _columns in REDUNDANT:
        op.drop_index(index, table_name=table)
    for table, index, columns, column in PARTIAL:
        op.drop_index(index, table_name=table)
        op.create_index(index, table, columns, unique=False, **_where(column))


def downgrade() -> None:
    for table, index, columns, _column in PARTIAL:
        op.drop_index(index, table_name=table)
        op.create_index(index, table, columns, unique=False)
    for table, index, columns in REDUNDANT:
        op.create_index(index, table, columns, unique=False)
