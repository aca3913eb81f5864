"""jobs.openai: what an OpenAI-style fine-tuning request asked for, beside the native spec

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 16:20:00

A job created through /v1/fine_tuning/jobs keeps the request's own words (the model as the
client named it, its suffix, the hyperparameters with what "auto" resolved to) so the
fine_tuning.job object shows them back; native jobs leave it null.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("openai", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "openai")
