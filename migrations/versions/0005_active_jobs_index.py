"""a partial index of each project's active jobs

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24 21:30:00

- ix_jobs_active_project: (project_id, dispatched_at) of the jobs whose status is queued,
  running, cancelling or pausing. The per-project quota and dispatch counts, taken under the
  project's lock on every job creation, read this index alone instead of every job row of the
  project (app.models, app.repositories.jobs).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As app.models' predicate was when this revision was written (a migration never follows the
# models: it must create what it created then).
ACTIVE_JOB = "status IN ('queued', 'running', 'cancelling', 'pausing')"


def upgrade() -> None:
    op.create_index(
        "ix_jobs_active_project",
        "jobs",
        ["project_id", "dispatched_at"],
        postgresql_where=sa.text(ACTIVE_JOB),
        sqlite_where=sa.text(ACTIVE_JOB),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_active_project", table_name="jobs")
