"""the peer tier: agents catalog and peer copies of shards

Revision ID: 2026_11_24_0007_peer_tier
Revises: 2026_11_24_0006
Create Date: 2026-11-24 08:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2026_11_24_0007_peer_tier"
down_revision: str | None = "2026_11_24_0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "agents",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("failure_domain", sa.String(length=255), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_agents")),
        sa.UniqueConstraint("node", name=op.f("uq_agents_node")),
    )
    op.create_table(
        "peer_copies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("shard_id", sa.Integer(), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("committed_at", sa.DateTime(), nullable=True),
        sa.Column("verified_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_peer_copies_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["shard_id"],
            ["shards.id"],
            name=op.f("fk_peer_copies_shard_id_shards"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_peer_copies")),
        sa.UniqueConstraint("shard_id", "node", name=op.f("uq_peer_copies_shard_id")),
    )
    with op.batch_alter_table("peer_copies", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_peer_copies_checkpoint_id"), ["checkpoint_id"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_peer_copies_node"), ["node"], unique=False)
        batch_op.create_index(batch_op.f("ix_peer_copies_shard_id"), ["shard_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("peer_copies", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_peer_copies_shard_id"))
        batch_op.drop_index(batch_op.f("ix_peer_copies_node"))
        batch_op.drop_index(batch_op.f("ix_peer_copies_checkpoint_id"))
    op.drop_table("peer_copies")
    op.drop_table("agents")
