"""The lease of a running job attempt, as the worker process holds it.

- `LeaseKeeper`: what the trainer's `should_stop` reads (lease lost, cancel or pause requested,
  shutdown requested). Entering it starts the heartbeat process (`worker.heartbeat`), which keeps the
  lease from outside this process, so a trainer holding the GIL cannot starve it; its reports
  and a synchronous fenced beat at each step boundary (`beat`) set the flags.
- `end_attempt`, `pause` and `release`: the fenced ways an attempt ends, shared by the runner
  and by the heartbeat process when it has to end the attempt of a trainer that did not stop in
  time.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import Session, sessionmaker

from app import transitions
from app.db import session_scope
from app.errors import IllegalTransition
from app.queue import Dispatcher
from app.repositories import jobs as jobs_repo
from app.services.dispatch import send_after_commit
from app.transitions import JobStatus
from worker.heartbeat import CANCEL, LOST, PAUSE, SHUTDOWN, HeartbeatProcess
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class LeaseKeeper:
    """The lease of `attempt`. With `settings`, entering it starts a heartbeat process that
    beats every `interval_s` (and enforces the stop grace); without, nothing beats in the
    background and the lease is refreshed only by `beat` (tests that drive callbacks by hand)."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        job_id: str,
        attempt: int,
        interval_s: float,
        *,
        settings: WorkerSettings | None = None,
    ) -> None:
        self._sessions = sessions
        self.job_id = job_id
        self.attempt = attempt
        self.lost = threading.Event()
        self.cancel_requested = threading.Event()
        self.pause_requested = threading.Event()
        self.shutdown_requested = threading.Event()
        self._process = (
            HeartbeatProcess(settings, job_id, attempt, interval_s)
            if settings is not None
            else None
        )

    def __enter__(self) -> LeaseKeeper:
        if self._process is not None:
            self._absorb(self._process.start())
        return self

    def __exit__(self, *_: object) -> None:
        # Waits for the heartbeat process to exit: once this returns, nothing but the caller
        # ends the attempt.
        if self._process is not None:
            self._absorb(self._process.stop())

    @property
    def heartbeat_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def refresh(self) -> None:
        """Take in what the heartbeat process reported since the last call (never blocks)."""
        if self._process is not None:
            self._absorb(self._process.reports())

    def beat(self) -> None:
        """One heartbeat from this process; sets `lost` or `cancel_requested` from what the
        database says."""
        with session_scope(self._sessions) as session:
            status = jobs_repo.heartbeat(session, job_id=self.job_id, attempt=self.attempt)
        if status is None:
            if not self.lost.is_set():
                log.warning("job %s attempt %s lost its lease", self.job_id, self.attempt)
            self.lost.set()
        elif status == JobStatus.CANCELLING:
            self.cancel_requested.set()
        elif status == JobStatus.PAUSING:
            self.pause_requested.set()
        elif status == JobStatus.RUNNING:
            # A resume before the worker stopped took the pause back.
            self.pause_requested.clear()

    def _absorb(self, reports: list[str]) -> None:
        flags = {
            LOST: self.lost,
            CANCEL: self.cancel_requested,
            PAUSE: self.pause_requested,
            SHUTDOWN: self.shutdown_requested,
        }
        for word in reports:
            if word in flags:
                flags[word].set()


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
