"""checkpoint retention and job deletion: sizes and deletion marks

Revision ID: 0003r
Revises: 0003w
Create Date: 2026-11-25 09:00:00

- checkpoints.size_bytes: the folder's size when recorded (usage per project, without walking
  disks); null for checkpoints recorded before this revision.
- checkpoints.deleted_at: deleted by the job's retention (the row stays: a download answers 410).
- jobs.deleted_at / jobs.purged_at: deleted by its owner (hidden at once), purged after a grace
  period by the workers' maintenance pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003r"
down_revision: str | None = "0003w"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("size_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("purged_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_jobs_deleted_at", "jobs", ["deleted_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_deleted_at", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("purged_at")
        batch.drop_column("deleted_at")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("deleted_at")
        batch.drop_column("size_bytes")
