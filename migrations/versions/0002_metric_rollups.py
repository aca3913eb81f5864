"""metric rollups: per-metric aggregates over aligned blocks of steps, for bounded-cost reads

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 09:00:00

Backfills the rollups of every metric row already stored, in SQL (one statement per backend),
so jobs recorded before this revision read the same way as new ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of app.repositories.metrics.ROLLUP_LEVELS and MAX_NAME_CHARS at this revision:
# a migration must not change when the application code does.
LEVELS = (4, 16, 64, 256, 1024, 4096, 16384)
MAX_NAME_CHARS = 200

_LEVELS_SQL = " UNION ALL ".join(f"SELECT {level} AS level" for level in LEVELS)

# One statement per backend: JSON functions differ. Only JSON numbers count as values (the
# worker stores non-finite values as null: n = 0); every row counts once under the name "".
_BACKFILL = {
    "postgresql": f"""
        INSERT INTO job_metric_rollups
            (job_id, level, name, block, count, total, min, max, last_step)
        SELECT p.job_id, p.level, p.name, (p.step + p.level - 1) / p.level,
               sum(p.n), coalesce(sum(p.v), 0), min(p.v), max(p.v),
               max(CASE WHEN p.n = 1 THEN p.step END)
        FROM (
            SELECT m.job_id, m.step, l.level, e.key AS name,
                   CASE WHEN json_typeof(e.value) = 'number'
                        THEN CAST(CAST(e.value AS TEXT) AS DOUBLE PRECISION) END AS v,
                   CASE WHEN json_typeof(e.value) = 'number' THEN 1 ELSE 0 END AS n
            FROM job_metrics m
            CROSS JOIN LATERAL json_each(m."values") AS e
            CROSS JOIN ({_LEVELS_SQL}) AS l
            WHERE length(e.key) BETWEEN 1 AND {MAX_NAME_CHARS}
            UNION ALL
            SELECT m.job_id, m.step, l.level, '' AS name, NULL AS v, 1 AS n
            FROM job_metrics m CROSS JOIN ({_LEVELS_SQL}) AS l
        ) AS p
        GROUP BY p.job_id, p.level, p.name, (p.step + p.level - 1) / p.level
    """,
    "sqlite": f"""
        INSERT INTO job_metric_rollups
            (job_id, level, name, block, count, total, min, max, last_step)
        SELECT p.job_id, p.level, p.name, (p.step + p.level - 1) / p.level,
               sum(p.n), coalesce(sum(p.v), 0.0), min(p.v), max(p.v),
               max(CASE WHEN p.n = 1 THEN p.step END)
        FROM (
            SELECT m.job_id, m.step, l.level, e.key AS name,
                   CASE WHEN e.type IN ('integer', 'real') THEN CAST(e.value AS REAL) END AS v,
                   CASE WHEN e.type IN ('integer', 'real') THEN 1 ELSE 0 END AS n
            FROM job_metrics m, json_each(m."values") AS e, ({_LEVELS_SQL}) AS l
            WHERE length(e.key) BETWEEN 1 AND {MAX_NAME_CHARS}
            UNION ALL
            SELECT m.job_id, m.step, l.level, '' AS name, NULL AS v, 1 AS n
            FROM job_metrics m, ({_LEVELS_SQL}) AS l
        ) AS p
        GROUP BY p.job_id, p.level, p.name, (p.step + p.level - 1) / p.level
    """,
}


def upgrade() -> None:
    op.create_table(
        "job_metric_rollups",
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("block", sa.Integer(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("total", sa.Float(), nullable=False),
        sa.Column("min", sa.Float(), nullable=True),
        sa.Column("max", sa.Float(), nullable=True),
        sa.Column("last_step", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "level", "name", "block"),
    )
    backfill = _BACKFILL.get(op.get_bind().dialect.name)
    if backfill is not None:
        op.execute(backfill)


def downgrade() -> None:
    op.drop_table("job_metric_rollups")
