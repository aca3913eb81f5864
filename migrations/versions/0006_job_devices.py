"""jobs.devices: the devices a job trains on, for the per-project device quota

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26 15:00:00

- jobs.devices: the spec's resources.devices (1 for every job stored before the spec had it),
  non-null; a project's device quota sums it over its active jobs (app.jobs.quota). A job
  stored with resources.devices in its spec takes that value.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The spec's resources.devices, read from the stored JSON (Postgres' json, SQLite's text).
SPEC_DEVICES = {
    "postgresql": "CAST(spec -> 'resources' ->> 'devices' AS INTEGER)",
    "sqlite": "CAST(json_extract(spec, '$.resources.devices') AS INTEGER)",
}


# Plain ALTER TABLE, never batch mode: on SQLite a batch that recreates `jobs` drops the old
# table, and its ON DELETE CASCADE children (metrics, events, checkpoints...) with it. SQLite
# adds a NOT NULL column with a default, and drops a column (3.35+), in place.


def upgrade() -> None:
    op.add_column(
        "jobs", sa.Column("devices", sa.Integer(), nullable=False, server_default=sa.text("1"))
    )
    devices = SPEC_DEVICES[op.get_bind().dialect.name]
    op.execute(f"UPDATE jobs SET devices = {devices} WHERE {devices} > 1")


def downgrade() -> None:
    op.drop_column("jobs", "devices")
