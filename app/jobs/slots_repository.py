"""Fair dispatch's queries: a job "holds a slot" from its send to the broker until it ends. A
queued job with no dispatched_at waits in the database for a slot of its project. Slots are
counted per size class (the job's queue): only workers of one size take a queue's jobs, so a
project's jobs of a size no worker runs hold that size's slots, not its other jobs'. The
project's counts of active jobs and devices (its quota, app.jobs.quota) are read here too.

Like app.jobs.repository, the queries every creation runs are built once, at import, with bound
parameters (its docstring says why)."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from sqlalchemy import ColumnElement, Row, bindparam, func, select
from sqlalchemy.orm import Session, aliased

from app.core import db
from app.core.job_status import LEASE_HOLDING_STATES, JobStatus
from app.core.models import Job, is_active

# The project's active jobs, as the partial index ix_jobs_active_project holds them (app.core.models
# .is_active says why the statuses are literals), so the counts below read that index.
_ACTIVE = is_active(Job.status)


def _holds_slot(job: type[Job] = Job) -> ColumnElement[bool]:
    return job.status.in_(LEASE_HOLDING_STATES) | (
        (job.status == JobStatus.QUEUED) & job.dispatched_at.is_not(None)
    )


def dispatch_row(
    session: Session, *, job_id: str
) -> Row[tuple[str, str, datetime | None, str]] | None:
    """(project_id, status, dispatched_at, queue), read fresh: whether the job still waits."""
    return session.execute(
        select(Job.project_id, Job.status, Job.dispatched_at, Job.queue).where(Job.id == job_id)
    ).one_or_none()


_HOLDER = aliased(Job, name="holder")
_DISPATCH_STATE = select(
    Job.project_id,
    Job.status,
    Job.dispatched_at,
    select(func.count())
    .select_from(_HOLDER)
    .where(
        _HOLDER.project_id == Job.project_id,
        is_active(_HOLDER.status),
        _HOLDER.queue == Job.queue,
        _holds_slot(_HOLDER),
    )
    .scalar_subquery()
    .label("slots_held"),
).where(Job.id == bindparam("job_id"))


def dispatch_state(
    session: Session, *, job_id: str
) -> Row[tuple[str, str, datetime | None, int]] | None:
    """(project_id, status, dispatched_at, slots_held): whether the job still waits, and how
    many dispatch slots of the job's size class its project holds (`count_dispatched`), read
    fresh in one round trip."""
    return session.execute(_DISPATCH_STATE, {"job_id": job_id}).one_or_none()


def count_dispatched(session: Session, *, project_id: str, queue: str | None = None) -> int:
    """The project's jobs handed to the broker or running (each holds a dispatch slot); of
    the size class of `queue` only, when given."""
    query = select(func.count()).select_from(Job).where(Job.project_id == project_id, _ACTIVE)
    if queue is not None:
        query = query.where(Job.queue == queue)
    return int(session.scalar(query.where(_holds_slot())) or 0)


_COUNT_ACTIVE = (
    select(func.count()).select_from(Job).where(Job.project_id == bindparam("project_id"), _ACTIVE)
)


def count_active(session: Session, *, project_id: str) -> int:
    """The project's jobs that are not finished: queued (sent or waiting), running, cancelling."""
    return int(session.scalar(_COUNT_ACTIVE, {"project_id": project_id}) or 0)


class ActiveCounts(NamedTuple):
    jobs: int  # the project's active jobs (`count_active`)
    dispatched: int  # of those, the ones of one size class holding a dispatch slot
    devices: int  # their resources.devices, summed


_COUNT_ACTIVE_AND_DISPATCHED = select(
    func.count(),
    func.count().filter(_holds_slot() & (Job.queue == bindparam("queue"))),
    func.coalesce(func.sum(Job.devices), 0),
).where(Job.project_id == bindparam("project_id"), _ACTIVE)


def count_active_and_dispatched(
    session: Session, *, project_id: str, queue: str | None = None
) -> ActiveCounts:
    """`count_active`, `count_dispatched` of the size class of `queue` (0 without one: a read
    of the quota alone) and the devices the active jobs ask for, in one pass over the
    project's active jobs (the jobs holding a dispatch slot are some of them)."""
    params = {"project_id": project_id, "queue": queue}
    row = db.execute_core(session, _COUNT_ACTIVE_AND_DISPATCHED, params).one()
    return ActiveCounts(int(row[0]), int(row[1]), int(row[2]))


def slots_by_queue(session: Session, *, project_id: str) -> dict[str, int]:
    """The dispatch slots the project holds in each size class (by queue) that has a job of
    the project waiting for one; one pass over the project's active jobs."""
    waits = (Job.status == JobStatus.QUEUED) & Job.dispatched_at.is_(None)
    rows = session.execute(
        select(Job.queue, func.count().filter(_holds_slot()), func.count().filter(waits))
        .where(Job.project_id == project_id, _ACTIVE)
        .group_by(Job.queue)
    )
    return {str(queue): int(held) for queue, held, waiting in rows if waiting}


def waiting(
    session: Session, *, project_id: str, queue: str, limit: int
) -> list[Row[tuple[str, str, datetime]]]:
    """(id, queue, created_at) of the project's queued jobs of one size class not sent yet,
    oldest first."""
    return list(
        session.execute(
            select(Job.id, Job.queue, Job.created_at)
            .where(
                Job.project_id == project_id,
                Job.queue == queue,
                Job.status == "queued",
                Job.dispatched_at.is_(None),
            )
            .order_by(Job.created_at, Job.id)
            .limit(limit)
        )
    )


def projects_waiting(session: Session, *, limit: int) -> list[str]:
    """Projects with queued jobs not sent yet, the one waiting longest first."""
    oldest = func.min(Job.created_at)
    return list(
        session.scalars(
            select(Job.project_id)
            .where(Job.status == "queued", Job.dispatched_at.is_(None))
            .group_by(Job.project_id)
            .order_by(oldest)
            .limit(limit)
        )
    )
