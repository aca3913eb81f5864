"""Why a run stops before its last step, declared once: the trainer's callbacks set one between
steps (:meth:`worker.progress.DatabaseCallbacks.should_stop`, from the lease's signals) and the
runner ends the attempt by it (:func:`worker.runner.run_job`). Also declared here: the failure
reasons after which the job is tried again rather than failed (:data:`RETRYABLE_REASONS`)."""

from __future__ import annotations

from typing import Literal, get_args

from trainer.errors import TrainerError
from worker.trackers import Outcome

__all__ = ["EXPORT_OUTCOMES", "RETRYABLE_REASONS", "RetryableReason", "StopReason", "retryable"]

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

# Trainer failure reasons (TrainerError.reason) of a job on several devices that say nothing
# about the job itself: a rank died (killed, out of memory; trainer.errors.RankFailed) or a
# collective of the ranks failed or timed out (trainer.distributed.world.DistributedTimeout).
# The attempt goes back to the queue, counted against max_attempts, and the next one resumes
# from the last checkpoint (worker.attempts.retry); a job that fails so every time ends failed
# with the reason once its attempts are used up. An async job's rollout server killed over and
# over (trainer.rollout.rollout_server.RolloutServerKilled: while it started, or through the
# client's restarts) is the same kind of failure.
RetryableReason = Literal["rank_failed", "distributed_timeout", "rollout_server_killed"]
RETRYABLE_REASONS: frozenset[str] = frozenset(get_args(RetryableReason))


def retryable(error: Exception | None) -> TrainerError | None:
    """`error` when another attempt may not meet it (a rank died), else None."""
    if isinstance(error, TrainerError) and error.reason in RETRYABLE_REASONS:
        return error
    return None
