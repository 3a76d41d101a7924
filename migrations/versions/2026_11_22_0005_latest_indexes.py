"""latest indexes: a checkpoint's children by (parent_run, parent_step)

`latest` (and every checkpoint detail) lists the checkpoint's children,
found by their parent; without this index that is a full scan of the
checkpoints table, growing with the catalog and the largest part of a
`latest` answer.

Revision ID: 2026_11_22_0005
Revises: 2026_11_22_0004
Create Date: 2026-11-22 14:30:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "2026_11_22_0005"
down_revision: str | None = "2026_11_22_0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index("ix_checkpoints_parent", ["parent_run", "parent_step"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoints_parent")
