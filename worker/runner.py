"""Run one job attempt: claim the lease, train with database callbacks, end the job.

Outcomes, each a fenced state change:
- trained every step            -> succeeded
- cancel requested              -> cancelled (after the trainer saved a checkpoint)
- SIGTERM to the worker         -> back to queued, re-sent, resumed by the next worker
- trainer error                 -> failed with the trainer's reason code
- lease lost (another attempt)  -> nothing: the new lease holder owns the job
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

from sqlalchemy import select

from app import transitions
from app.db import session_scope
from app.errors import IllegalTransition
from app.models import Checkpoint, File, Job
from app.services.dispatch import send_job
from app.transitions import JobStatus
from trainer.config import DatasetSpec, JobSpec, PromptRow
from trainer.errors import TrainerError
from worker.context import WorkerContext
from worker.lease import LeaseKeeper
from worker.progress import DatabaseCallbacks, LeaseLost

log = logging.getLogger(__name__)


def load_spec(ctx: WorkerContext, job: Job) -> JobSpec:
    """The stored spec, with an uploaded file resolved into inline rows."""
    spec = JobSpec.model_validate(job.spec)
    file_id = spec.dataset.file_id
    if file_id is None:
        return spec
    with session_scope(ctx.sessions) as session:
        file = session.get(File, file_id)
        if file is None:
            raise TrainerError(f"dataset file {file_id} no longer exists", reason="file_missing")
        rows = [PromptRow.model_validate(r) for r in file.rows]
    data = spec.dataset.model_dump()
    data.update(file_id=None, rows=rows)
    return spec.model_copy(update={"dataset": DatasetSpec.model_validate(data)})


def latest_checkpoint(ctx: WorkerContext, job_id: str) -> Path | None:
    """The newest checkpoint recorded for the job whose folder still exists."""
    with session_scope(ctx.sessions) as session:
        rows = session.scalars(
            select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc())
        ).all()
    for row in rows:
        path = Path(row.path)
        if path.is_dir():
            return path
    return None


def _end(
    ctx: WorkerContext, job_id: str, attempt: int, target: JobStatus, **kwargs: object
) -> None:
    try:
        with session_scope(ctx.sessions) as session:
            transitions.transition(session, job_id, target, attempt=attempt, **kwargs)  # type: ignore[arg-type]
    except IllegalTransition as exc:
        log.warning("job %s could not end as %s: %s", job_id, target, exc)
    ctx.tail.notify(job_id, "status")


def release(ctx: WorkerContext, job_id: str, attempt: int, message: str) -> None:
    """Hand the job back to the queue without spending one of its attempts."""
    with session_scope(ctx.sessions) as session:
        job = session.get(Job, job_id)
        if job is None:
            return
        queue = job.queue
        transitions.transition(
            session,
            job_id,
            JobStatus.QUEUED,
            attempt=attempt,
            message=message,
            values={"lease_owner": None, "max_attempts": job.max_attempts + 1},
        )
    send_job(ctx.sessions, ctx.dispatcher, job_id, queue)


def run_job(ctx: WorkerContext, job_id: str) -> str:
    """Run one attempt of `job_id`; returns a short outcome word (for logs and tests)."""
    settings = ctx.settings
    with session_scope(ctx.sessions) as session:
        attempt = transitions.claim(session, job_id, settings.worker_name)
        job = session.get(Job, job_id) if attempt is not None else None
        if job is not None:
            session.refresh(job)
    if attempt is None or job is None:
        log.info("job %s is not claimable (lease held, finished or cancelled)", job_id)
        return "not_claimed"

    with LeaseKeeper(ctx.sessions, job_id, attempt, settings.heartbeat_seconds) as lease:
        callbacks = DatabaseCallbacks(ctx, job_id, attempt, lease)
        try:
            spec = load_spec(ctx, job)
            from trainer.loop import train  # torch is imported only once a job really runs

            resume_from = latest_checkpoint(ctx, job_id)
            result = train(
                spec,
                callbacks,
                output_dir=settings.resolved_checkpoint_dir / job_id,
                resume_from=resume_from,
                device=settings.device,
            )
        except LeaseLost:
            return "lease_lost"
        except TrainerError as exc:
            if lease.lost.is_set():
                return "lease_lost"
            _end(ctx, job_id, attempt, JobStatus.FAILED, message=str(exc), error_code=exc.reason)
            return "failed"
        except Exception as exc:
            if lease.lost.is_set():
                return "lease_lost"
            log.exception("job %s failed", job_id)
            message = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"[:4000]
            _end(
                ctx, job_id, attempt, JobStatus.FAILED, message=message, error_code="trainer_error"
            )
            return "failed"

    reason = callbacks.stop_reason
    if reason == "lease_lost" or lease.lost.is_set():
        return "lease_lost"
    if reason == "cancelled" and result.stopped_early:
        _end(
            ctx,
            job_id,
            attempt,
            JobStatus.CANCELLED,
            message=f"cancelled at step {result.final_step}",
        )
        return "cancelled"
    if reason == "shutdown" and result.stopped_early:
        release(ctx, job_id, attempt, f"worker shut down at step {result.final_step}; re-queued")
        return "released"
    _end(ctx, job_id, attempt, JobStatus.SUCCEEDED, message=f"finished {result.final_step} steps")
    return "succeeded"
