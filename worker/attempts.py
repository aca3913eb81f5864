"""The fenced ways a job attempt ends, shared by the runner and by the heartbeat process
(`worker.heartbeat`) when it has to end the attempt of a trainer that did not stop in time:

- `end_attempt`: to a final state (or back to the queue through a failure), fenced by the attempt;
- `pause`: paused, the lease released and the attempt not counted against the job;
- `release`: handed back to the queue without spending an attempt (paused instead when the job
  is being paused);
- `retry`: handed back to the queue after a failure another attempt may not meet (a rank of a
  job on several devices died), spending the attempt; failed once the attempts are used up.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session, sessionmaker

from app.core.db import session_scope
from app.core.errors import IllegalTransition
from app.core.queue import Dispatcher
from app.jobs import repository as jobs_repo
from app.jobs import transitions
from app.jobs.dispatch import send_after_commit
from app.jobs.transitions import JobStatus

log = logging.getLogger(__name__)


def end_attempt(
    sessions: sessionmaker[Session],
    job_id: str,
    attempt: int,
    target: JobStatus,
    *,
    message: str,
    error_code: str | None = None,
) -> bool:
    """Move the job to `target`, fenced by `attempt`; False (logged) when the attempt no longer
    holds the lease or the change is not allowed any more."""
    try:
        with session_scope(sessions) as session:
            transitions.transition(
                session, job_id, target, attempt=attempt, message=message, error_code=error_code
            )
    except IllegalTransition as exc:
        log.warning("job %s could not end as %s: %s", job_id, target, exc)
        return False
    return True


def _hand_back(
    sessions: sessionmaker[Session],
    job_id: str,
    attempt: int,
    target: JobStatus,
    message: str,
    dispatcher: Dispatcher | None = None,
) -> bool:
    """Move the job out of this attempt to `target` (paused, or queued and re-sent through
    `dispatcher` after the commit), releasing the lease without counting the attempt against
    the job. False (logged) when the attempt no longer holds the lease or the move is not
    allowed any more."""
    try:
        with session_scope(sessions) as session:
            job = jobs_repo.get(session, job_id=job_id)
            if job is None:
                return False
            transitions.transition(
                session,
                job_id,
                target,
                attempt=attempt,
                message=message,
                values={"lease_owner": None, "max_attempts": job.max_attempts + 1},
            )
            if dispatcher is not None:
                send_after_commit(session, dispatcher, job_id=job_id, queue=job.queue)
    except IllegalTransition as exc:
        log.warning("job %s could not go to %s: %s", job_id, target, exc)
        return False
    return True


def pause(sessions: sessionmaker[Session], job_id: str, attempt: int, message: str) -> bool:
    """End a pausing attempt as paused: the lease is released and the attempt is not counted
    against the job (a pause is not a failure); a resume queues it again, and the next claim
    continues from its last checkpoint. False (logged) when the attempt no longer holds the
    lease or the pause was taken back meanwhile."""
    return _hand_back(sessions, job_id, attempt, JobStatus.PAUSED, message)


def release(
    sessions: sessionmaker[Session], dispatcher: Dispatcher, job_id: str, attempt: int, message: str
) -> bool:
    """Hand the job back to the queue without spending one of its attempts; it is re-sent once
    the hand-over is committed. A job being paused is paused instead (that is what its owner
    asked for). False (logged) when the attempt no longer holds the lease."""
    with session_scope(sessions) as session:
        job = jobs_repo.get(session, job_id=job_id)
        pausing = job is not None and job.status == JobStatus.PAUSING
    if pausing:
        return pause(sessions, job_id, attempt, f"{message.split(';')[0]} while pausing; paused")
    return _hand_back(sessions, job_id, attempt, JobStatus.QUEUED, message, dispatcher)


def retry(
    sessions: sessionmaker[Session],
    dispatcher: Dispatcher,
    job_id: str,
    attempt: int,
    reason: str,
    message: str,
) -> str:
    """End an attempt that failed for `reason`, one of `worker.stop_reasons.RETRYABLE_REASONS`:
    back to the queue (re-sent once committed; the next claim resumes from the last
    checkpoint), the attempt counted against `max_attempts`, as the reaper does for a lost
    worker. With no attempt left the job fails with `reason` and `message`. A job being
    cancelled is cancelled and one being paused is paused, as its owner asked (its last
    checkpoint stays). Returns the outcome: requeued, failed, cancelled, paused, or
    lease_lost when the attempt no longer holds the lease."""
    try:
        with session_scope(sessions) as session:
            job = jobs_repo.get(session, job_id=job_id)
            if job is None:
                return "lease_lost"
            status, max_attempts, queue = JobStatus(job.status), job.max_attempts, job.queue
            why = f"{reason}: {message}"
            if status == JobStatus.CANCELLING:
                transitions.transition(
                    session, job_id, JobStatus.CANCELLED, attempt=attempt,
                    message=f"{why}; cancelled as asked",
                )  # fmt: skip
                return "cancelled"
            if status == JobStatus.PAUSING:
                transitions.transition(
                    session, job_id, JobStatus.PAUSED, attempt=attempt,
                    message=f"{why}; paused at its last checkpoint as asked",
                    values={"lease_owner": None, "max_attempts": max_attempts + 1},
                )  # fmt: skip
                return "paused"
            if attempt >= max_attempts:
                transitions.transition(
                    session, job_id, JobStatus.FAILED, attempt=attempt, error_code=reason,
                    message=f"{message} (attempt {attempt} of {max_attempts}; none left)",
                )  # fmt: skip
                return "failed"
            transitions.transition(
                session, job_id, JobStatus.QUEUED, attempt=attempt, level="warning",
                message=f"{why}; re-queued to resume from its last checkpoint "
                f"(attempt {attempt} of {max_attempts})",
                values={"lease_owner": None},
            )  # fmt: skip
            send_after_commit(session, dispatcher, job_id=job_id, queue=queue)
            return "requeued"
    except IllegalTransition as exc:
        log.warning("job %s could not be retried after %s: %s", job_id, reason, exc)
        return "lease_lost"
