"""The job state machine: the only code that assigns `jobs.status`.

    queued -> running -> succeeded | failed | cancelled
    running -> cancelling (cancel asked) -> cancelled
    running | cancelling -> queued (lease released: worker lost or shut down; attempt kept)
    queued -> paused; running -> pausing (pause asked) -> paused (the trainer checkpointed and
    stopped; the lease is released, the attempt kept); pausing -> running (resumed before the
    worker stopped); running -> paused (the trainer paused itself: the async mismatch guard);
    paused -> queued (resume) | cancelled

Every change is a compare-and-set `UPDATE ... WHERE status = :seen [AND attempt = :attempt]` plus
an event row in the same transaction, so concurrent finishers, cancellers and reapers can never
both win, and a worker that lost its lease (stale attempt) changes nothing. This module owns the
rules (the table below, fencing); the statements themselves live in `app.jobs.repository`
(`compare_and_set`, called from nowhere else) and `app.jobs.events_repository`. Entering running,
succeeded, failed or cancelled also queues the project's webhooks in the same transaction
(app.webhooks.outbox).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement
from sqlalchemy.orm import Session

from app.core import db
from app.core.clock import utcnow
from app.core.errors import IllegalTransition, NotFound
from app.core.job_status import LEASE_HOLDING_STATES, JobStatus
from app.core.models import Job, JobEvent
from app.jobs import events_repository as events_repo
from app.jobs import repository as jobs_repo
from app.webhooks.outbox import record_job_event
from app.webhooks.protocol import STATUS_EVENTS

TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
# Entering one of these frees the job's dispatch slot (app.jobs.dispatch refills it).
FREES_SLOT = TERMINAL | {JobStatus.PAUSED}

ALLOWED: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.CANCELLED, JobStatus.PAUSED}),
    JobStatus.RUNNING: frozenset(
        {
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.CANCELLING,
            JobStatus.CANCELLED,
            JobStatus.QUEUED,
            JobStatus.PAUSING,
            # The trainer paused the job itself (the async mismatch guard), with its reason.
            JobStatus.PAUSED,
        }
    ),
    JobStatus.CANCELLING: frozenset({JobStatus.CANCELLED, JobStatus.FAILED, JobStatus.SUCCEEDED}),
    # A job asked to pause may still finish or fail first; a cancel overrides the pause; a
    # resume before the worker stopped takes the pause back.
    JobStatus.PAUSING: frozenset(
        {
            JobStatus.PAUSED,
            JobStatus.CANCELLING,
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.RUNNING,
        }
    ),
    JobStatus.PAUSED: frozenset({JobStatus.QUEUED, JobStatus.CANCELLED}),
    JobStatus.SUCCEEDED: frozenset(),
    # A resume (app.jobs.pausing) queues a failed job again from its last checkpoint.
    JobStatus.FAILED: frozenset({JobStatus.QUEUED}),
    JobStatus.CANCELLED: frozenset(),
}

# Timestamps stamped when a job enters a state.
_ENTRY_STAMPS: dict[JobStatus, str] = {
    JobStatus.SUCCEEDED: "finished_at",
    JobStatus.FAILED: "finished_at",
    JobStatus.CANCELLED: "finished_at",
    JobStatus.CANCELLING: "cancel_requested_at",
}


# `session.info` key of work to run once a job's end is committed: `hook(session, job_id=...)`.
# app.jobs.dispatch installs it (it refills the project's dispatch slot); it sits above this
# module, so the state machine only knows the key.
ON_JOB_ENDED = "grpo_on_job_ended"


def is_allowed(source: JobStatus | str, target: JobStatus | str) -> bool:
    return JobStatus(target) in ALLOWED[JobStatus(source)]


def add_event(
    session: Session,
    job_id: str,
    event_type: str,
    message: str,
    *,
    attempt: int = 0,
    level: str = "info",
    data: dict[str, Any] | None = None,
) -> JobEvent:
    event = JobEvent(
        job_id=job_id,
        attempt=attempt,
        type=event_type,
        level=level,
        message=message,
        data=data,
        created_at=utcnow(),
    )
    return events_repo.add(session, event=event)


def record_created(session: Session, job: Job) -> None:
    """Insert a new job in `queued` with its `created` event (one INSERT each, no ORM flush:
    job creation is the API's hot path; `job` stays out of the session)."""
    job.status = JobStatus.QUEUED
    jobs_repo.insert_new(session, job=job)
    events_repo.insert_new(
        session,
        event=JobEvent(
            job_id=job.id,
            attempt=0,
            type="created",
            level="info",
            message="job created",
            data={"status": JobStatus.QUEUED.value},
            created_at=utcnow(),
        ),
    )


def transition(
    session: Session,
    job_id: str,
    target: JobStatus,
    *,
    attempt: int | None = None,
    message: str | None = None,
    error_code: str | None = None,
    values: dict[str, Any] | None = None,
    level: str = "info",
    only_if: Sequence[ColumnElement[bool]] | None = None,
) -> JobStatus:
    """Move a job to `target`; return the status it left.

    `attempt`, when given, fences the write: a worker whose lease was taken over (the job's
    attempt moved on) gets IllegalTransition and changes nothing.
    Raises NotFound for an unknown job and IllegalTransition for a change the state machine
    does not allow from the job's current status. `only_if` adds conditions to the
    compare-and-set (the reaper uses it to re-check that the heartbeat is still stale).
    """
    row = jobs_repo.status_and_attempt(session, job_id=job_id)
    if row is None:
        raise NotFound(f"job {job_id} not found", param="job_id")
    source = JobStatus(row.status)
    if attempt is not None and (row.attempt != attempt or source not in LEASE_HOLDING_STATES):
        # A fenced write is valid only while that attempt holds the lease: the job is running
        # (or cancelling) under the same attempt. A re-queued job keeps its attempt number
        # until the next claim, so the status check matters as much as the number.
        raise IllegalTransition(
            f"job {job_id} attempt {attempt} no longer holds the lease "
            f"(status {source}, attempt {row.attempt})"
        )
    if not is_allowed(source, target):
        raise IllegalTransition(f"job {job_id} cannot go from {source} to {target}")
    now = utcnow()
    changes: dict[str, Any] = {"status": target.value, "updated_at": now, **(values or {})}
    stamp = _ENTRY_STAMPS.get(target)
    if stamp:
        changes.setdefault(stamp, now)
    if error_code is not None:
        changes["error_code"] = error_code
        changes["error_message"] = message
    matched = jobs_repo.compare_and_set(
        session,
        job_id=job_id,
        seen_status=source.value,
        attempt=attempt,
        values=changes,
        only_if=list(only_if or []),
    )
    if not matched:
        raise IllegalTransition(f"job {job_id} changed concurrently; {target} not applied")
    add_event(
        session,
        job_id,
        "status",
        message or f"{source} -> {target}",
        attempt=row.attempt,
        level="error" if target == JobStatus.FAILED else level,
        data={"from": source.value, "to": target.value, "error_code": error_code},
    )
    _queue_webhooks(session, job_id, target, source)
    hook = session.info.get(ON_JOB_ENDED)
    if target in FREES_SLOT and hook is not None:
        db.after_commit(session, functools.partial(hook, job_id=job_id))
    return source


def claim(session: Session, job_id: str, owner: str) -> int | None:
    """Take the lease of a queued job: attempt += 1 in one conditional update.

    Returns the new attempt number, or None when the job is not claimable (someone else holds
    the lease, it was cancelled, it is finished, or it used up its attempts)."""
    now = utcnow()
    job = jobs_repo.get(session, job_id=job_id)
    if job is None or job.status != JobStatus.QUEUED or job.attempt >= job.max_attempts:
        return None
    attempt = job.attempt + 1
    matched = jobs_repo.compare_and_set(
        session,
        job_id=job_id,
        seen_status=JobStatus.QUEUED.value,
        attempt=job.attempt,
        values={
            "status": JobStatus.RUNNING.value,
            "attempt": attempt,
            "lease_owner": owner,
            "heartbeat_at": now,
            "updated_at": now,
            "started_at": job.started_at or now,
        },
    )
    if not matched:
        return None
    add_event(
        session,
        job_id,
        "status",
        f"queued -> running (attempt {attempt} on {owner})",
        attempt=attempt,
        data={"from": "queued", "to": "running", "owner": owner},
    )
    _queue_webhooks(session, job_id, JobStatus.RUNNING, JobStatus.QUEUED)
    return attempt


def _queue_webhooks(session: Session, job_id: str, target: JobStatus, source: JobStatus) -> None:
    """The webhook outbox rows of a status change, in its transaction (app.webhooks.outbox)."""
    event_type = STATUS_EVENTS.get(target.value)
    if event_type is not None:
        record_job_event(session, job_id, event_type, previous_status=source.value)
