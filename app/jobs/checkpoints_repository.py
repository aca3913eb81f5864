"""Checkpoint queries beyond recording and listing them (`app.progress.repository`):

- admission's lookup (a job may start from one of its own project's checkpoints);
- the retention pass of a running job (the metric value a checkpoint ranks by, marking the
  checkpoints it does not keep as deleted);
- usage: the bytes of a project's kept checkpoints, from the sizes recorded with them;
- the checkpoint storage quota: the bytes a project stores (deleted jobs' checkpoints too,
  until their purge), counted under a per-project lock;
- the model catalogue (app.gateway): the newest kept checkpoints of a page of jobs.

A checkpoint row marked deleted stays (its download answers 410) until its job is purged.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import Integer, Row, Select, case, cast, func, literal, select, update
from sqlalchemy.orm import Session

from app.core.models import Checkpoint, Job, JobMetric

# The first key of the transaction-scoped advisory locks of checkpoint storage (the second is
# the project id's hash): a namespace of this service's own.
_STORAGE_LOCK_CLASS = 0x6772706F  # "grpo"


def checkpoint_of_project_job(
    session: Session, *, project_id: str, job_id: str, step: int
) -> Checkpoint | None:
    """The kept checkpoint of `job_id` at `step`, when that job belongs to `project_id` and was
    not deleted; else None (another project's job, a deleted one and a missing one look the
    same)."""
    return session.scalars(
        select(Checkpoint)
        .join(Job, Job.id == Checkpoint.job_id)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.step == step,
            Checkpoint.deleted_at.is_(None),
            Job.project_id == project_id,
            Job.deleted_at.is_(None),
        )
    ).one_or_none()


def newest_kept(
    session: Session, *, job_ids: Sequence[str], per_job: int
) -> dict[str, list[Checkpoint]]:
    """The newest (highest step first) `per_job` kept checkpoints of each of `job_ids` (the
    caller's jobs: this checks no project), in one query; a job without any is left out."""
    if not job_ids or per_job < 1:
        return {}
    rank = (
        func.row_number()
        .over(partition_by=Checkpoint.job_id, order_by=Checkpoint.step.desc())
        .label("rank")
    )
    ranked = (
        select(Checkpoint.id, rank)
        .where(Checkpoint.job_id.in_(list(job_ids)), Checkpoint.deleted_at.is_(None))
        .subquery()
    )
    rows = session.scalars(
        select(Checkpoint)
        .join(ranked, ranked.c.id == Checkpoint.id)
        .where(ranked.c.rank <= per_job)
        .order_by(Checkpoint.job_id, Checkpoint.step.desc())
    )
    found: dict[str, list[Checkpoint]] = {}
    for row in rows:
        found.setdefault(row.job_id, []).append(row)
    return found


def metric_at_or_before(session: Session, *, job_id: str, name: str, step: int) -> float | None:
    """The job's latest recorded value of metric `name` at a step <= `step` (steps that did not
    report it, or reported a non-finite value, stored as null, are skipped); None if none."""
    value = JobMetric.values[name].as_float()
    return session.scalar(
        select(value)
        .where(JobMetric.job_id == job_id, JobMetric.step <= step, value.is_not(None))
        .order_by(JobMetric.step.desc())
        .limit(1)
    )


def mark_deleted(session: Session, *, job_id: str, steps: Sequence[int], now: datetime) -> None:
    """Mark the job's checkpoints at `steps` deleted (their folders are removed after commit)."""
    if not steps:
        return
    session.execute(
        update(Checkpoint)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.step.in_(list(steps)),
            Checkpoint.deleted_at.is_(None),
        )
        .values(deleted_at=now)
        .execution_options(synchronize_session=False)
    )


def deleted_paths(session: Session, *, job_id: str) -> list[str]:
    """The recorded folders of the job's deleted checkpoints (some may be gone already)."""
    return list(
        session.scalars(
            select(Checkpoint.path).where(
                Checkpoint.job_id == job_id, Checkpoint.deleted_at.is_not(None)
            )
        )
    )


def _kept_of_project(project_id: str) -> Select[tuple[str, int, int]]:
    """Per job of the project not deleted: (job_id, bytes, count) of its kept checkpoints."""
    return (
        select(
            Checkpoint.job_id,
            func.coalesce(func.sum(Checkpoint.size_bytes), 0).label("bytes"),
            func.count().label("checkpoints"),
        )
        .join(Job, Job.id == Checkpoint.job_id)
        .where(
            Job.project_id == project_id,
            Job.deleted_at.is_(None),
            Checkpoint.deleted_at.is_(None),
        )
        .group_by(Checkpoint.job_id)
    )


def usage_totals(session: Session, *, project_id: str) -> tuple[int, int, int]:
    """(bytes, checkpoints, jobs) of the project's kept checkpoints of jobs not deleted."""
    per_job = _kept_of_project(project_id).subquery()
    row = session.execute(
        select(
            func.coalesce(func.sum(per_job.c.bytes), 0),
            func.coalesce(func.sum(per_job.c.checkpoints), 0),
            func.count(),
        ).select_from(per_job)
    ).one()
    return int(row[0]), int(row[1]), int(row[2])


def usage_by_job(
    session: Session, *, project_id: str, limit: int
) -> list[Row[tuple[str, int, int]]]:
    """(job_id, bytes, checkpoints) of the project's jobs holding kept checkpoints, the largest
    first (then the newest job), at most `limit`."""
    per_job = _kept_of_project(project_id).subquery()
    return list(
        session.execute(
            select(per_job.c.job_id, per_job.c.bytes, per_job.c.checkpoints)
            .order_by(per_job.c.bytes.desc(), per_job.c.job_id.desc())
            .limit(limit)
        )
    )


def lock_storage(session: Session, *, project_id: str) -> None:
    """Serialise, until this transaction ends, the checkpoint writes of the project that count
    its stored bytes, so two of its jobs saving at once cannot both pass the quota.

    Postgres: a transaction-scoped advisory lock keyed by the project (only checkpoint writers
    take it, so it waits on nothing else; a hash collision only serialises two projects' saves).
    SQLite: nothing to take, the caller's fenced update already holds the database's write lock."""
    if session.get_bind().dialect.name == "postgresql":
        namespace = cast(literal(_STORAGE_LOCK_CLASS), Integer)
        session.execute(select(func.pg_advisory_xact_lock(namespace, func.hashtext(project_id))))


def stored_bytes(session: Session, *, project_id: str) -> tuple[int, int]:
    """(bytes, of them the deleted jobs' bytes) of the project's stored checkpoints: every
    checkpoint row not deleted by its job's retention, of jobs not yet purged (the purge
    removes the rows), from the sizes recorded with them (null, before sizes were: 0).
    One query: the jobs of the project joined to their checkpoint rows."""
    size = func.coalesce(Checkpoint.size_bytes, 0)
    row = session.execute(
        select(
            func.coalesce(func.sum(size), 0),
            func.coalesce(func.sum(case((Job.deleted_at.is_not(None), size), else_=0)), 0),
        )
        .select_from(Checkpoint)
        .join(Job, Job.id == Checkpoint.job_id)
        .where(Job.project_id == project_id, Checkpoint.deleted_at.is_(None))
    ).one()
    return int(row[0]), int(row[1])
