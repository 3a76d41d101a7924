"""chunk hashes per file (a reader verifies the byte ranges it reads)

Revision ID: 2026_11_24_0006
Revises: 2026_11_22_0005
Create Date: 2026-11-24 06:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2026_11_24_0006"
down_revision: str | None = "2026_11_22_0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: files uploaded before keep NULL (readers fall
    # back to whole-file reads verified by the file's SHA-256).
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.add_column(sa.Column("chunk_size", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("chunk_sha256", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_column("chunk_sha256")
        batch_op.drop_column("chunk_size")
