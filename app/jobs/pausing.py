"""Pause and resume: a paused job keeps its checkpoints and gives its worker back.

Pausing a queued job parks it at once. Pausing a running one asks its worker to stop (pausing);
the trainer finishes its step, writes a checkpoint, and the worker records the job as paused
and releases the lease, without counting the attempt against the job (worker.attempts.pause).
Resuming a paused job queues it again under the project's quota and fair dispatch, and the next
worker continues from the last checkpoint, as after any hand-over. Resuming a job that is still
pausing takes the pause back. Both are idempotent; a finished or cancelling job is a 409.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.orm import Session

from app.core.errors import Conflict, IllegalTransition
from app.core.models import Job
from app.core.queue import Dispatcher
from app.jobs import repository as jobs_repo
from app.jobs import transitions
from app.jobs.dispatch import send_after_commit, withdraw_after_commit
from app.jobs.quota import ActiveLimits, check_active_jobs
from app.jobs.transitions import JobStatus


def _settle(session: Session, job: Job, act: Callable[[JobStatus], None], verb: str) -> Job:
    """Run `act` on the job's current status, re-reading and retrying when a worker changed it
    concurrently (the compare-and-set then wrote nothing); the job as it is afterwards."""
    for _ in range(3):
        try:
            act(JobStatus(job.status))
        except _Refused as refused:
            # 409 of type invalid_state: final, unlike the "changing state" conflict below,
            # which a client retries.
            raise IllegalTransition(str(refused), param="job_id") from None
        except IllegalTransition:
            jobs_repo.reload(session, job=job)
            continue
        return jobs_repo.reload(session, job=job)
    raise Conflict(f"job {job.id} is changing state; retry the {verb}", param="job_id")


class _Refused(Exception):
    """The job's state rules the action out for good (not a race to retry)."""


def _refuse(job: Job, status: JobStatus, verb: str) -> _Refused:
    why = "has ended" if status in transitions.TERMINAL else "is being cancelled"
    return _Refused(f"job {job.id} {why} ({status}); it cannot be {verb}d")


def pause_job(session: Session, *, job: Job) -> Job:
    """Queued -> paused at once; running -> pausing (its worker stops within a step and records
    it paused); pausing or paused: returned as is."""

    def act(status: JobStatus) -> None:
        if status == JobStatus.QUEUED:
            transitions.transition(session, job.id, JobStatus.PAUSED, message="paused while queued")
            if job.dispatched_at is not None:  # its message leaves the broker (a resume sends anew)
                withdraw_after_commit(session, job_id=job.id, queue=job.queue)
        elif status == JobStatus.RUNNING:
            transitions.transition(session, job.id, JobStatus.PAUSING, message="pause requested")
        elif status not in (JobStatus.PAUSING, JobStatus.PAUSED):
            raise _refuse(job, status, "pause")

    return _settle(session, job, act, "pause")


def resume_job(session: Session, *, job: Job, dispatcher: Dispatcher, limits: ActiveLimits) -> Job:
    """Paused -> queued, within the project's quota of active jobs and their devices (429
    beyond it) and sent, to the queue it was created for, after the commit when the project has
    a free dispatch slot; pausing -> running (the pause is taken back); queued or running:
    returned as is."""

    def act(status: JobStatus) -> None:
        if status == JobStatus.PAUSED:
            transitions.transition(session, job.id, JobStatus.QUEUED, message="resumed")
            held = check_active_jobs(
                session, project_id=job.project_id, limits=limits, queue=job.queue
            )
            send_after_commit(session, dispatcher, job_id=job.id, queue=job.queue, slots_held=held)
        elif status == JobStatus.PAUSING:
            transitions.transition(
                session, job.id, JobStatus.RUNNING, message="resumed before it paused"
            )
        elif status not in (JobStatus.QUEUED, JobStatus.RUNNING):
            raise _refuse(job, status, "resume")

    return _settle(session, job, act, "resume")
