"""Sending a job to its queue and recording when: the one place every sender (create, the
sweep, the reaper, a worker handing a job back) goes through, so `dispatched_at` is always
right for the sweep that reads it."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from app.db import session_scope
from app.queue import Dispatcher
from app.repositories import jobs as jobs_repo


def send_job(
    sessions: sessionmaker[Session], dispatcher: Dispatcher, job_id: str, queue: str
) -> bool:
    """Publish the job to `queue`; on success stamp `dispatched_at`. False when the broker is
    unreachable: the job stays queued and the sweep tries again."""
    if not dispatcher.send(job_id, queue):
        return False
    with session_scope(sessions) as session:
        jobs_repo.mark_dispatched(session, job_id)
    return True
