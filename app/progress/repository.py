"""What a running job produces: metrics, samples, checkpoints.

Each is unique per (job, step) and inserted with ON CONFLICT DO NOTHING, so a resumed attempt
that repeats a step writes nothing twice; a checkpoint saved again replaced its folder, so its
row takes the new folder's facts instead. Metric reads are in app.progress.metrics_repository; the
checkpoint retention and usage queries in app.jobs.checkpoints_repository."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.core.models import Checkpoint, JobMetric, JobSample
from app.progress import metrics_repository as metrics_repo


def _insert_once(
    session: Session, model: type[Any], row: dict[str, Any], *, replace: bool = False
) -> bool:
    """INSERT ... ON CONFLICT DO NOTHING on the unique (job_id, step) key (with `replace`: DO
    UPDATE, the row takes `row`'s values); True if a row was written.

    Told by the row RETURNING gives back: the driver's rowcount is -1 for this statement on
    Postgres (psycopg), which read as "inserted" for a step that was already there."""
    dialect = session.get_bind().dialect.name
    if dialect in ("postgresql", "sqlite"):
        base = (postgresql if dialect == "postgresql" else sqlite).insert(model).values(**row)
        if replace:
            updates = {k: v for k, v in row.items() if k not in ("job_id", "step")}
            stmt: Any = base.on_conflict_do_update(index_elements=["job_id", "step"], set_=updates)
        else:
            stmt = base.on_conflict_do_nothing()
    else:  # pragma: no cover - other databases are not supported
        stmt = insert(model).values(**row)
    return session.execute(stmt.returning(model.id)).first() is not None


def add_metrics_once(
    session: Session,
    *,
    job_id: str,
    step: int,
    attempt: int,
    values: dict[str, float | None],
    now: datetime,
) -> bool:
    """Store a step's metrics unless that step is stored already; whether it was stored now."""
    row = {"job_id": job_id, "step": step, "attempt": attempt, "values": values, "created_at": now}
    if not _insert_once(session, JobMetric, row):  # a repeated step must not count twice
        return False
    metrics_repo.add_rollups(session, job_id=job_id, acc=metrics_repo.rollups_of([(step, values)]))
    return True


def add_samples_once(
    session: Session, *, job_id: str, step: int, attempt: int, data: list[Any], now: datetime
) -> None:
    row = {"job_id": job_id, "step": step, "attempt": attempt, "data": data, "created_at": now}
    _insert_once(session, JobSample, row)


def add_checkpoint_once(
    session: Session,
    *,
    job_id: str,
    step: int,
    attempt: int,
    path: Path,
    now: datetime,
    size_bytes: int | None = None,
    metrics: dict[str, float | None] | None = None,
) -> None:
    """Record the checkpoint of (job, step). A step saved again (a resumed run repeating it)
    replaced the folder: the row then takes the new folder's facts and is live again."""
    row = {
        "job_id": job_id,
        "step": step,
        "attempt": attempt,
        "path": str(path),
        "created_at": now,
        "size_bytes": size_bytes,
        "metrics": metrics,
        "deleted_at": None,
    }
    _insert_once(session, Checkpoint, row, replace=True)


def metrics_after(session: Session, *, job_id: str, after_step: int, limit: int) -> list[JobMetric]:
    query = (
        select(JobMetric)
        .where(JobMetric.job_id == job_id, JobMetric.step > after_step)
        .order_by(JobMetric.step)
        .limit(limit)
    )
    return list(session.scalars(query))


def samples_page(
    session: Session, *, job_id: str, after_step: int | None, step: int | None, limit: int
) -> tuple[list[JobSample], bool]:
    query = select(JobSample).where(JobSample.job_id == job_id)
    if step is not None:
        query = query.where(JobSample.step == step)
    if after_step is not None:
        query = query.where(JobSample.step > after_step)
    rows = list(session.scalars(query.order_by(JobSample.step).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def checkpoints(session: Session, *, job_id: str, newest_first: bool = False) -> list[Checkpoint]:
    """The job's checkpoints that are kept (not deleted by its retention)."""
    order = Checkpoint.step.desc() if newest_first else Checkpoint.step
    query = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.deleted_at.is_(None))
    return list(session.scalars(query.order_by(order)))


def checkpoint_at(session: Session, *, job_id: str, step: int) -> Checkpoint | None:
    """The job's checkpoint row at `step`, deleted or not (a deleted one answers 410)."""
    return session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
    ).one_or_none()


def checkpoints_before(
    session: Session, *, job_id: str, before_step: int | None, limit: int
) -> tuple[list[Checkpoint], bool]:
    """A page of the job's kept checkpoints, newest first, below `before_step` when given."""
    query = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.deleted_at.is_(None))
    if before_step is not None:
        query = query.where(Checkpoint.step < before_step)
    rows = list(session.scalars(query.order_by(Checkpoint.step.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def checkpoint_by_id(session: Session, *, job_id: str, checkpoint_id: int) -> Checkpoint | None:
    return session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.id == checkpoint_id)
    ).one_or_none()


def metric_values_at(
    session: Session, *, job_id: str, steps: list[int]
) -> dict[int, dict[str, Any]]:
    """The metrics recorded at each of `steps` (absent steps are left out)."""
    if not steps:
        return {}
    query = select(JobMetric.step, JobMetric.values).where(
        JobMetric.job_id == job_id, JobMetric.step.in_(steps)
    )
    return {int(step): values for step, values in session.execute(query)}
