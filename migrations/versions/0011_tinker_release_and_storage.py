"""Tinker clients released when idle, stored calls bounded, workers announce what they hold

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07 06:00:00

- tinker_models.queued_at: when the model last went to the queue (created, or called again
  after an idle release): what the claim timeout counts from; dispatched_at: its last message
  (the maintenance sweep sends a waiting model again); idle_state: the folder a released model
  was written to, loaded back on its next call.
- tinker_requests.body becomes nullable (dropped once the call is applied or refused);
  stored_bytes (the body's and result's bytes still held, counted against the project's
  limit) and retrieved_at (a result is dropped a little after the client read it).
- workers.tinker_models: the Tinker training clients a worker held when it last announced
  itself (a job waiting for its size class says so).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tinker_models") as batch:
        batch.add_column(sa.Column("queued_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("idle_state", sa.String(length=1000), nullable=True))
    with op.batch_alter_table("tinker_requests") as batch:
        batch.alter_column("body", existing_type=sa.LargeBinary(), nullable=True)
        batch.add_column(
            sa.Column("stored_bytes", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("retrieved_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(
            sa.Column("tinker_models", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("tinker_models")
    with op.batch_alter_table("tinker_requests") as batch:
        batch.drop_column("retrieved_at")
        batch.drop_column("stored_bytes")
        batch.alter_column("body", existing_type=sa.LargeBinary(), nullable=False)
    with op.batch_alter_table("tinker_models") as batch:
        batch.drop_column("idle_state")
        batch.drop_column("dispatched_at")
        batch.drop_column("queued_at")
