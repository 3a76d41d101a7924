"""files sha256 index (dedup looks files up by content hash)

Revision ID: 2026_11_22_0004
Revises: 2026_11_22_0003
Create Date: 2026-11-22 14:05:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "2026_11_22_0004"
down_revision: str | None = "2026_11_22_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.create_index("ix_files_sha256", ["sha256"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_index("ix_files_sha256")
