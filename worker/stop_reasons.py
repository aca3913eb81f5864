"""Why a run stops before its last step, declared once: the trainer's callbacks set one between
steps (:meth:`worker.progress.DatabaseCallbacks.should_stop`, from the lease's signals) and the
runner ends the attempt by it (:func:`worker.runner.run_job`)."""

from __future__ import annotations

from typing import Literal

from worker.trackers import Outcome

__all__ = ["EXPORT_OUTCOMES", "StopReason"]

# lease_lost: another attempt owns the job (this one writes nothing more); cancelled, paused:
# asked through the API; shutdown: this worker is stopping (SIGTERM), the job goes back to the
# queue.
StopReason = Literal["lease_lost", "cancelled", "paused", "shutdown"]

# How the job's tracker runs end when the run stopped for each reason.
EXPORT_OUTCOMES: dict[StopReason, Outcome] = {
    "lease_lost": "stopped",
    "cancelled": "cancelled",
    "paused": "stopped",
    "shutdown": "stopped",
}
