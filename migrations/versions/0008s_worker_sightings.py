"""workers: the size classes of the workers that run, as each announces itself

Revision ID: 0008s
Revises: 0007
Create Date: 2026-11-27 12:00:00

- workers: one row per worker process (its name), with its deployment's queue name, its device
  count (its size class) and when it was last seen; each worker rewrites its row every
  maintenance pass. The API warns a job whose size class no recent worker has
  (app.jobs.workers_repository).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008s"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("name", sa.String(300), primary_key=True),
        sa.Column("queue_name", sa.String(200), nullable=False),
        sa.Column("devices", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_workers_queue_name_last_seen_at", "workers", ["queue_name", "last_seen_at"])


def downgrade() -> None:
    op.drop_index("ix_workers_queue_name_last_seen_at", table_name="workers")
    op.drop_table("workers")
