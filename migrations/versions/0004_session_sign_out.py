"""dashboard sign-out: the time before which a key's session tokens are signed out

Revision ID: 0004
Revises: 0003r
Create Date: 2026-11-24 21:00:00

- api_keys.sessions_valid_after: `DELETE /v1/session` sets it to now; a session token issued at
  or before it is refused (null: none signed out).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003r"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(
            sa.Column("sessions_valid_after", sa.DateTime(timezone=True), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("sessions_valid_after")
