"""Periodic repairs that make the queue lossless:

- the reaper re-queues running jobs whose heartbeat went stale (their worker died), or fails them
  with `worker_lost` once they used all their attempts;
- the sweep re-sends queued jobs whose message is older than a threshold (the broker may have
  lost it; a duplicate message is harmless because claiming takes the lease), and sends jobs
  waiting for a dispatch slot into the free slots, round-robin across projects
  (app.jobs.dispatch: fair dispatch);
- the purge removes what deleted jobs produced once their grace period is over: their
  checkpoint folders first, then their samples, metrics, rollups, events and checkpoint rows
  (app.jobs.deletion says how a job is deleted).
- the announcement rewrites this worker's row of the workers table (its size class), so the
  API can tell a job that no worker of its size runs (app.jobs.size_classes);
- the registry clean-up deletes the rows of inference processes gone for an hour (a process
  killed outright never removes its own row; the gateway reads only fresh rows, but the table
  would grow with every restart);
- the Tinker clean-up removes the saves past their expiry (a TTL, or a delete through the
  Tinker API): their folders and rows (worker.tinker_saves.remove_expired_saves);
- a job that waits because every worker of its size holds Tinker training clients is told
  so in its events, once (app.jobs.size_classes.note_jobs_waiting_for_tinker);
- the Tinker upkeep sends waiting training clients again, closes released clients of ended
  sessions and bounds the stored calls (worker.tinker_upkeep).
Every worker runs them; compare-and-set transitions make concurrent runs safe, and the purge's
steps are idempotent.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from sqlalchemy.exc import SQLAlchemyError

from app.core.clock import utcnow
from app.core.db import session_scope
from app.core.errors import IllegalTransition
from app.gateway import servers_repository
from app.jobs import deletion_repository as deletion_repo
from app.jobs import repository as jobs_repo
from app.jobs import size_classes, transitions
from app.jobs import slots_repository as slots_repo
from app.jobs import workers_repository as workers_repo
from app.jobs.dispatch import fill_slots, send_after_commit, send_job
from app.jobs.transitions import JobStatus
from worker.context import WorkerContext
from worker.retention import remove_job_folder
from worker.tinker_saves import remove_expired_saves
from worker.tinker_upkeep import tinker_upkeep

log = logging.getLogger(__name__)

# Most jobs (and projects) one sweep handles; the rest wait for the next sweep.
SWEEP_BATCH = 1000
# A worker's row stays this long after it was last seen (then it is gone for good).
FORGET_WORKERS_AFTER = timedelta(days=7)
# An inference process's row stays this long after its last heartbeat.
FORGET_INFERENCE_SERVERS_AFTER = timedelta(hours=1)


def announce_worker(ctx: WorkerContext) -> None:
    """Record that this worker runs now, with its size class (the devices it trains on)."""
    settings = ctx.settings
    now = utcnow()
    with session_scope(ctx.sessions) as session:
        workers_repo.announce(
            session,
            name=settings.worker_name,
            queue_name=settings.queue_name,
            # A worker that takes no jobs (GRPO_WORKER_SERVES=tinker) is no size class's.
            devices=settings.devices() if settings.serves_jobs else 0,
            now=now,
            tinker_models=len(ctx.held_tinker_models),
            device=settings.device_announced(),
        )
        workers_repo.forget_before(
            session, queue_name=settings.queue_name, before=now - FORGET_WORKERS_AFTER
        )


def reap_stale_jobs(ctx: WorkerContext) -> list[str]:
    """Re-queue (or fail) running jobs whose lease expired; returns the ids it re-queued."""
    cutoff = utcnow() - timedelta(seconds=ctx.settings.lease_seconds)
    requeued: list[str] = []
    with session_scope(ctx.sessions) as session:
        stale = [
            (j.id, j.attempt, j.max_attempts, j.status, j.queue)
            for j in jobs_repo.stale_running(session, older_than=cutoff)
        ]
    for job_id, attempt, max_attempts, status, queue in stale:
        still_stale = [jobs_repo.heartbeat_older_than(cutoff)]
        try:
            # One task boundary per job: a job another reaper (or its worker) got to first
            # rolls back alone, and the re-queued job is sent only once its row is committed.
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
                elif status == JobStatus.PAUSING:
                    # What the user asked for: paused, from its last checkpoint; the lost
                    # attempt is not counted against it (the pause, not a failure, ended it).
                    transitions.transition(
                        session,
                        job_id,
                        JobStatus.PAUSED,
                        attempt=attempt,
                        message="worker lost while pausing; paused at its last checkpoint",
                        values={"lease_owner": None, "max_attempts": max_attempts + 1},
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
                    # Back to the queue the job was created for, whichever queue this worker
                    # consumes.
                    send_after_commit(session, ctx.dispatcher, job_id=job_id, queue=queue)
                    requeued.append(job_id)
        except IllegalTransition:
            continue  # the worker came back or another reaper won: nothing to do
    return requeued


def redispatch_queued(ctx: WorkerContext) -> list[str]:
    """Send again every queued job whose last message is older than the threshold, then fill
    the projects' free dispatch slots with their waiting jobs; returns the ids sent. A job of a
    size class that no worker of its deployment announced lately is not sent again: its message
    would wait in the broker with the others, each sweep adding one; once such a worker
    announces itself, the next sweep sends it (app.jobs.size_classes)."""
    cutoff = utcnow() - timedelta(seconds=ctx.settings.redispatch_seconds)
    with session_scope(ctx.sessions) as session:
        nobody_takes = size_classes.workers_seen(session, ctx.settings).queues_nobody_takes()
        lost = [
            (j.id, j.queue)
            for j in jobs_repo.lost_messages(
                session, older_than=cutoff, limit=SWEEP_BATCH, skip_queues=nobody_takes
            )
        ]
    sent: list[str] = []
    for job_id, queue in lost:
        # These rows are committed already, so the send happens now; each stamp of
        # `dispatched_at` is its own short unit of work. A lost message's job holds its slot
        # already: re-sending it adds none.
        with session_scope(ctx.sessions) as session:
            if not send_job(session, ctx.dispatcher, job_id=job_id, queue=queue):
                return sent  # broker down: the next sweep tries again
        sent.append(job_id)
    return sent + fill_round_robin(ctx)


def fill_round_robin(ctx: WorkerContext) -> list[str]:
    """Send waiting jobs into free dispatch slots one per project per round, the project
    waiting longest first and the oldest job first within a project, until no project can
    send more. Each send is its own unit of work under the project's lock (exact counts
    against the API and other workers doing the same)."""
    cap = ctx.settings.max_dispatched_per_project
    with session_scope(ctx.sessions) as session:
        projects = slots_repo.projects_waiting(session, limit=SWEEP_BATCH)
    sent: list[str] = []
    while projects and len(sent) < SWEEP_BATCH:
        for project_id in list(projects):
            with session_scope(ctx.sessions) as session:
                filled = fill_slots(
                    session, ctx.dispatcher, project_id=project_id, cap=cap, limit=1
                )
            sent += filled.sent
            if filled.broker_down:
                return sent  # the next sweep tries again
            if not filled.sent:
                projects.remove(project_id)  # full, or nothing left waiting
    return sent


def note_jobs_waiting_for_tinker(ctx: WorkerContext) -> list[str]:
    """Tell each job waiting for a size class whose every worker holds Tinker training clients
    why it waits, once (app.jobs.size_classes); returns the ids told."""
    return size_classes.note_jobs_waiting_for_tinker(ctx.sessions, ctx.settings)


def purge_deleted_jobs(ctx: WorkerContext) -> list[str]:
    """Purge the jobs deleted more than `delete_grace_seconds` ago: their checkpoint folder,
    then their rows (a crash in between leaves the job to the next pass); returns their ids."""
    cutoff = utcnow() - timedelta(seconds=ctx.settings.delete_grace_seconds)
    with session_scope(ctx.sessions) as session:
        due = [row[0] for row in deletion_repo.purgeable(session, deleted_before=cutoff, limit=100)]
    purged: list[str] = []
    for job_id in due:
        remove_job_folder(ctx.settings.resolved_checkpoint_dir, job_id)
        with session_scope(ctx.sessions) as session:
            deletion_repo.purge_rows(session, job_id=job_id, now=utcnow())
        purged.append(job_id)
    return purged


def forget_gone_inference_servers(ctx: WorkerContext) -> int:
    """Delete the registry rows of inference processes whose last heartbeat is older than
    FORGET_INFERENCE_SERVERS_AFTER; how many went."""
    with session_scope(ctx.sessions) as session:
        return servers_repository.remove_stale(
            session, older_than_s=FORGET_INFERENCE_SERVERS_AFTER.total_seconds()
        )


class MaintenanceThread:
    """Runs the reaper, the sweep, the purges and the registry clean-up every
    `maintenance_seconds` until stopped."""

    def __init__(self, ctx: WorkerContext) -> None:
        self._ctx = ctx
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grpo-maintenance", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        self._announce()  # at once: the API may be asked for a job of this size right away
        while not self._stop.wait(self._ctx.settings.maintenance_seconds):
            self._announce()
            try:
                reap_stale_jobs(self._ctx)
                redispatch_queued(self._ctx)
                note_jobs_waiting_for_tinker(self._ctx)
                purge_deleted_jobs(self._ctx)
                forget_gone_inference_servers(self._ctx)
                remove_expired_saves(self._ctx.sessions, self._ctx.settings.resolved_checkpoint_dir)
                tinker_upkeep(self._ctx)
            except SQLAlchemyError as exc:
                log.warning("maintenance skipped: database unavailable (%s)", exc)
            except Exception:  # never let the thread die
                log.exception("maintenance failed")

    def _announce(self) -> None:
        # Apart from the repairs: a failed announcement must never skip the reaper.
        try:
            announce_worker(self._ctx)
        except SQLAlchemyError as exc:
            log.warning("could not announce this worker: database unavailable (%s)", exc)
        except Exception:
            log.exception("could not announce this worker")
