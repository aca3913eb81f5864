"""Periodic repairs that make the queue lossless:

- the reaper re-queues running jobs whose heartbeat went stale (their worker died), or fails them
  with `worker_lost` once they used all their attempts;
- the sweep re-sends queued jobs whose message is older than a threshold (the broker may have
  lost it; a duplicate message is harmless because claiming takes the lease).
Every worker runs them; compare-and-set transitions make concurrent runs safe.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from sqlalchemy.exc import SQLAlchemyError

from app import transitions
from app.clock import utcnow
from app.db import session_scope
from app.errors import IllegalTransition
from app.models import Job
from app.repositories import jobs as jobs_repo
from app.services.dispatch import send_job
from app.transitions import JobStatus
from worker.context import WorkerContext

log = logging.getLogger(__name__)


def reap_stale_jobs(ctx: WorkerContext) -> list[str]:
    """Re-queue (or fail) running jobs whose lease expired; returns the ids it re-queued."""
    cutoff = utcnow() - timedelta(seconds=ctx.settings.lease_seconds)
    requeued: list[tuple[str, str]] = []
    with session_scope(ctx.sessions) as session:
        stale = [
            (j.id, j.attempt, j.max_attempts, j.status, j.queue)
            for j in jobs_repo.stale_running(session, cutoff)
        ]
    for job_id, attempt, max_attempts, status, queue in stale:
        still_stale = [Job.heartbeat_at.is_(None) | (Job.heartbeat_at < cutoff)]
        try:
            with session_scope(ctx.sessions) as session:
                if status == JobStatus.CANCELLING:
                    transitions.transition(
                        session,
                        job_id,
                        JobStatus.CANCELLED,
                        attempt=attempt,
                        message="worker lost while cancelling",
                        only_if=still_stale,
                    )
                elif attempt >= max_attempts:
                    transitions.transition(
                        session,
                        job_id,
                        JobStatus.FAILED,
                        attempt=attempt,
                        error_code="worker_lost",
                        message=f"worker lost {attempt} times (max_attempts={max_attempts})",
                        only_if=still_stale,
                    )
                else:
                    transitions.transition(
                        session,
                        job_id,
                        JobStatus.QUEUED,
                        attempt=attempt,
                        message=f"heartbeat stale for over {ctx.settings.lease_seconds:.0f}s; "
                        "re-queued",
                        values={"lease_owner": None},
                        level="warning",
                        only_if=still_stale,
                    )
                    requeued.append((job_id, queue))
        except IllegalTransition:
            continue  # the worker came back or another reaper won: nothing to do
    for job_id, queue in requeued:
        _send(ctx, job_id, queue)
    return [job_id for job_id, _ in requeued]


def redispatch_queued(ctx: WorkerContext) -> list[str]:
    """Send again every queued job whose last message is older than the threshold."""
    cutoff = utcnow() - timedelta(seconds=ctx.settings.redispatch_seconds)
    with session_scope(ctx.sessions) as session:
        due = [(j.id, j.queue) for j in jobs_repo.undispatched_queued(session, cutoff)]
    return [job_id for job_id, queue in due if _send(ctx, job_id, queue)]


def _send(ctx: WorkerContext, job_id: str, queue: str) -> bool:
    """Re-send to the queue the job was created for, whichever queue this worker consumes."""
    return send_job(ctx.sessions, ctx.dispatcher, job_id, queue)


class MaintenanceThread:
    """Runs the reaper and the sweep every `maintenance_seconds` until stopped."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grpo-maintenance", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._ctx.settings.maintenance_seconds):
            try:
                reap_stale_jobs(self._ctx)
                redispatch_queued(self._ctx)
            except SQLAlchemyError as exc:
                log.warning("maintenance skipped: database unavailable (%s)", exc)
            except Exception:  # never let the thread die
                log.exception("maintenance failed")
