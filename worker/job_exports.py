"""A job attempt's tracker exports (``integrations``, :mod:`worker.trackers`): started with the
attempt, ended before its outcome is written, with the run's final checkpoint and status sent
within ``tracker_flush_seconds``; what was not exported becomes an ``export_failed`` event. A
tracker never changes the job's outcome (:func:`worker.runner.run_job`)."""

from __future__ import annotations

import contextlib
import logging

from app.core.models import Job
from worker.progress import DatabaseCallbacks, LeaseLost
from worker.settings import WorkerSettings
from worker.stop_reasons import EXPORT_OUTCOMES, retryable
from worker.trackers import Exports, Outcome, start_exports

__all__ = ["close_exports", "export_outcome", "start_job_exports"]

log = logging.getLogger(__name__)


def start_job_exports(settings: WorkerSettings, job_id: str, job: Job) -> Exports:
    """The job's tracker exports; a spec this worker cannot read exports nothing (the run
    itself then fails on the same spec, with the reason)."""
    try:
        return start_exports(job_id, job.spec, settings)
    except Exception:
        log.exception("job %s: tracker exports could not start", job_id)
        return Exports()


def export_outcome(callbacks: DatabaseCallbacks, error: Exception | None, lost: bool) -> Outcome:
    if lost or isinstance(error, LeaseLost):
        return "stopped"  # another attempt owns the job, and the run
    if retryable(error) is not None:
        return "stopped"  # another attempt may continue the run
    if error is not None:
        return "failed"
    if callbacks.stop_reason is not None:
        return EXPORT_OUTCOMES[callbacks.stop_reason]
    return "succeeded"


def close_exports(callbacks: DatabaseCallbacks, outcome: Outcome, timeout: float) -> None:
    """End the tracker runs (at most `timeout` seconds) and record what was not exported as
    events."""
    exports = callbacks.exports
    if exports.idle:
        return
    tags: dict[str, str] = {}
    step = callbacks.last_checkpoint_step
    if step is not None and outcome != "failed":
        # A reference to the checkpoint through the API, never the worker's path.
        tags = {
            "grpo.final_checkpoint": f"/v1/jobs/{callbacks.job_id}/checkpoints/{step}/download",
            "grpo.final_checkpoint_step": str(step),
        }
    reports = exports.close(tags, outcome, timeout)
    if outcome == "stopped" and callbacks.lease.lost.is_set():
        return  # this attempt may write nothing more
    with contextlib.suppress(Exception):  # the job's outcome does not depend on its trackers
        callbacks.report_exports(reports)
