"""Job queries. Reads made for a caller take the project id, so another project's job is simply
not found. Status changes go through `compare_and_set`, which only `app.jobs.transitions` calls.

The queries every job creation runs are built once, at import, with bound parameters: building
a statement (and its cache key) on each call cost more of the API's CPU than running it, about
0.3 ms each, and 2 ms for a statement with an aliased entity (BENCHMARKS.md, "API: job
creation under load")."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Row,
    and_,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.core.job_status import LEASE_HOLDING_STATES, JobStatus
from app.core.models import Checkpoint, Job, JobEvent
from app.core.new_rows_repository import insert_row


def add(session: Session, *, job: Job) -> Job:
    session.add(job)
    session.flush()
    return job


def insert_new(session: Session, *, job: Job) -> Job:
    """`add` without the ORM's unit of work (app.core.new_rows_repository); `job` stays transient."""
    insert_row(session, job)
    return job


def get(session: Session, *, job_id: str) -> Job | None:
    """Any project's job: for workers and the stream, which hold an id they were given."""
    return session.get(Job, job_id)


def project_of(session: Session, *, job_id: str) -> str | None:
    """The project id of any job (None: no such job)."""
    return session.scalar(select(Job.project_id).where(Job.id == job_id))


def get_for_project(session: Session, *, project_id: str, job_id: str) -> Job | None:
    """The project's job, unless its owner deleted it (a deleted job is not found)."""
    return session.scalars(
        select(Job).where(Job.id == job_id, Job.project_id == project_id, Job.deleted_at.is_(None))
    ).one_or_none()


def reload(session: Session, *, job: Job) -> Job:
    """Re-read a loaded job; bulk updates (compare-and-set) bypass the identity map."""
    session.refresh(job)
    return job


def list_page(
    session: Session,
    *,
    project_id: str,
    after: str | None,
    limit: int,
    statuses: list[str] | None,
    metadata: dict[str, str] | None = None,
    with_kept_checkpoints: bool = False,
) -> tuple[list[Job], bool]:
    """Newest first, deleted jobs left out. `after` is the last id of the previous page; ids
    are time-ordered. `metadata`: only jobs whose spec's metadata has each key with that value.
    `with_kept_checkpoints`: only jobs holding a checkpoint their retention kept (the jobs
    with weights to serve: the model catalogue, app.gateway)."""
    query = select(Job).where(Job.project_id == project_id, Job.deleted_at.is_(None))
    if statuses:
        query = query.where(Job.status.in_(statuses))
    if with_kept_checkpoints:
        kept = select(Checkpoint.id).where(
            Checkpoint.job_id == Job.id, Checkpoint.deleted_at.is_(None)
        )
        query = query.where(kept.exists())
    for key, value in (metadata or {}).items():
        query = query.where(Job.spec["metadata"][key].as_string() == value)
    if after:
        query = query.where(Job.id < after)
    rows = list(session.scalars(query.order_by(Job.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def status_and_attempt(session: Session, *, job_id: str) -> Row[tuple[str, int]] | None:
    """The two columns a state change decides on, read fresh (never from the identity map)."""
    return session.execute(select(Job.status, Job.attempt).where(Job.id == job_id)).one_or_none()


def compare_and_set(
    session: Session,
    *,
    job_id: str,
    seen_status: str,
    attempt: int | None,
    values: dict[str, Any],
    only_if: list[ColumnElement[bool]] | None = None,
) -> bool:
    """`UPDATE jobs SET values WHERE id AND status = seen [AND attempt] [AND only_if]`; True when
    it matched. Only `app.jobs.transitions` calls this: it owns the rules of every status change."""
    condition: list[ColumnElement[bool]] = [Job.id == job_id, Job.status == seen_status]
    if attempt is not None:
        condition.append(Job.attempt == attempt)
    condition.extend(only_if or [])
    result = session.execute(
        update(Job).where(*condition).values(**values).execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def heartbeat_older_than(cutoff: datetime) -> ColumnElement[bool]:
    """A condition for compare-and-set: the lease is still stale (no heartbeat since `cutoff`)."""
    return Job.heartbeat_at.is_(None) | (Job.heartbeat_at < cutoff)


def mark_dispatched(session: Session, *, job_id: str) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(dispatched_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def mark_undispatched(session: Session, *, job_id: str) -> None:
    """The job needs a (new) message: it waits for a dispatch slot of its project."""
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(dispatched_at=None)
        .execution_options(synchronize_session=False)
    )


def heartbeat(session: Session, *, job_id: str, attempt: int) -> str | None:
    """Refresh the lease of `attempt`; return the job status, or None when the lease is lost."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempt == attempt, Job.status.in_(LEASE_HOLDING_STATES))
        .values(heartbeat_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        return None
    return session.scalar(select(Job.status).where(Job.id == job_id))


def update_progress(session: Session, *, job_id: str, attempt: int, values: dict[str, Any]) -> bool:
    """Progress fields (step, last metrics) of the lease holder; False if the lease is lost."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.attempt == attempt, Job.status.in_(LEASE_HOLDING_STATES))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def stale_running(session: Session, *, older_than: datetime) -> list[Job]:
    """Running jobs whose worker stopped heartbeating (or never did)."""
    return list(
        session.scalars(
            select(Job).where(
                Job.status.in_(LEASE_HOLDING_STATES),
                or_(
                    Job.heartbeat_at < older_than,
                    and_(Job.heartbeat_at.is_(None), Job.updated_at < older_than),
                ),
            )
        )
    )


def _queued_and_sent_before(cutoff: datetime) -> ColumnElement[bool]:
    """Queued (and its message sent) before `cutoff`, and still not claimed."""
    return and_(Job.status == "queued", Job.dispatched_at < cutoff, Job.updated_at < cutoff)


def lost_messages(
    session: Session, *, older_than: datetime, limit: int, skip_queues: Collection[str] = ()
) -> list[Job]:
    """Queued jobs sent to the broker before `older_than` and still not claimed: the broker may
    have lost their message. (They hold a dispatch slot already, so a re-send adds none.) Not
    those of `skip_queues` (no worker takes them: a re-send would only pile messages up)."""
    query = select(Job).where(_queued_and_sent_before(older_than))
    if skip_queues:
        query = query.where(Job.queue.not_in(list(skip_queues)))
    return list(session.scalars(query.order_by(Job.dispatched_at).limit(limit)))


def waiting_without_event(
    session: Session, *, queues: Collection[str], queued_before: datetime, event: str, limit: int
) -> list[Row[tuple[str, int, str]]]:
    """(id, attempt, queue) of the jobs of `queues` queued and sent before `queued_before` with
    no `event` event of their current attempt, the oldest message first."""
    said = select(JobEvent.id).where(
        JobEvent.job_id == Job.id, JobEvent.type == event, JobEvent.attempt == Job.attempt
    )
    query = select(Job.id, Job.attempt, Job.queue).where(
        _queued_and_sent_before(queued_before), Job.queue.in_(list(queues)), ~said.exists()
    )
    return list(session.execute(query.order_by(Job.dispatched_at).limit(limit)))


def hold_queued(session: Session, *, job_id: str, attempt: int) -> bool:
    """Hold the job's row until this unit of work ends, while it is queued at `attempt` (a
    no-op write: Postgres's row lock, SQLite's write lock), so that concurrent sweeps decide
    about it one at a time; False when it is no longer so."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.QUEUED, Job.attempt == attempt)
        .values(attempt=Job.attempt)
        .execution_options(synchronize_session=False)
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def live_job_using_file(
    session: Session, *, project_id: str, file_id: str, ended: Sequence[str]
) -> str | None:
    """The id of one of the project's jobs not in an `ended` status whose dataset names
    `file_id` (as its training or validation file), or None."""
    dataset = Job.spec["dataset"]
    query = (
        select(Job.id)
        .where(
            Job.project_id == project_id,
            Job.status.not_in(ended),
            or_(
                dataset["file_id"].as_string() == file_id,
                dataset["validation_file_id"].as_string() == file_id,
            ),
        )
        .limit(1)
    )
    return session.scalars(query).first()


def project_activity(session: Session, *, project_id: str) -> tuple[Any, ...]:
    """A fingerprint of the project's jobs that changes whenever one is created, deleted,
    changes status or finishes a step (`updated_at` moves on each of those): their count, the
    latest `updated_at` and the sum of their steps. One aggregate over the project's index."""
    row = session.execute(
        select(func.count(), func.max(Job.updated_at), func.sum(Job.current_step)).where(
            Job.project_id == project_id, Job.deleted_at.is_(None)
        )
    ).one()
    return tuple(row)
