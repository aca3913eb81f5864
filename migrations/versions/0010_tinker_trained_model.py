"""tinker_models.trained_model: the packaged model a model-name alias trains

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 09:00:00

A Tinker training client may name its base model by an alias (GRPO_TINKER_MODEL_ALIASES, for
clients such as tinker-cookbook that take the name from a table of their own); the packaged
model the alias stood for is recorded at creation, so the client's saves keep their model.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tinker_models") as batch:
        batch.add_column(sa.Column("trained_model", sa.String(length=300), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tinker_models") as batch:
        batch.drop_column("trained_model")
