"""inference_servers and inference_usage: the serving tier's registry and its token counts

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 18:00:00

- inference_servers: one row per running `grpo inference` process, rewritten every heartbeat;
  the gateway routes a request to a fresh row that serves the model's base.
- inference_usage: requests and tokens served per project, model name and UTC day, for
  GET /v1/usage and the per-project daily token quota.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "inference_servers",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("control_url", sa.String(2048), nullable=False),
        sa.Column("bases", sa.JSON(), nullable=False),
        sa.Column("state", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_inference_servers_heartbeat_at", "inference_servers", ["heartbeat_at"])
    op.create_table(
        "inference_usage",
        sa.Column(
            "project_id",
            sa.String(40),
            sa.ForeignKey("projects.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("model", sa.String(1200), primary_key=True),
        sa.Column("day", sa.String(10), primary_key=True),
        sa.Column("requests", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column(
            "completion_tokens", sa.BigInteger(), nullable=False, server_default=sa.text("0")
        ),
    )


def downgrade() -> None:
    op.drop_table("inference_usage")
    op.drop_index("ix_inference_servers_heartbeat_at", table_name="inference_servers")
    op.drop_table("inference_servers")
