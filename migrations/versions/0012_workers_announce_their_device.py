"""Workers announce their device

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07 11:00:00

- workers.device_kind ("cuda" or "cpu") and workers.device_memory (one device's bytes): what
  a worker trains on, written with its size class, so the API plans a job for its workers'
  device when the operator declared none (an API host without the workers' GPUs would
  otherwise plan every job as a CPU job).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("device_kind", sa.String(length=8), nullable=True))
        batch.add_column(sa.Column("device_memory", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("device_memory")
        batch.drop_column("device_kind")
