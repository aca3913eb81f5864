"""The trainer's callbacks, implemented against the database.

Every write is fenced by the attempt number: it first updates the job row `WHERE attempt =
:attempt AND status IN (running, cancelling)`, and only when that matched does it insert metrics,
samples, events or checkpoints, all in one transaction. A worker that lost its lease therefore
writes nothing, and a step written twice (a resumed run repeating a step) is ignored by the
unique (job, step) keys.

Each step the database stored (once) also goes to the job's experiment trackers
(:class:`worker.trackers.Exports`: queued, never waited on), and what a tracker export could
not deliver comes back as an ``export_failed`` job event at the next step.
Checkpoint retention (the job spec's ``checkpoint`` section) is applied here, not by the
trainer: ``worker.retention`` says how. So is the project's checkpoint storage quota
(``app.usage.service``): a checkpoint that would take the project over it is not
kept, and the run ends with :class:`CheckpointQuotaExceeded`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Any, NoReturn

from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.core.db import session_scope
from app.jobs import checkpoints_repository as checkpoints_repo
from app.jobs import repository as jobs_repo
from app.jobs.transitions import add_event
from app.progress import repository as progress_repo
from app.usage import service as checkpoint_quota
from app.usage.service import StorageUse
from app.webhooks.outbox import record_job_event
from app.webhooks.protocol import CHECKPOINT_EVENT
from jobspec import CheckpointSpec
from jobspec.checkpoint_files import folder_bytes
from trainer.errors import TrainerError
from trainer.run.callbacks import Callbacks, RolloutSample, RunInfo
from worker.context import WorkerContext
from worker.lease import LeaseKeeper
from worker.retention import record_checkpoint, remove_folders
from worker.retry import with_db_retry
from worker.stop_reasons import StopReason
from worker.trackers import Exports, Report


def _steps(steps: list[int], shown: int = 10) -> str:
    head = ", ".join(str(s) for s in steps[:shown])
    return head + (f" and {len(steps) - shown} more" if len(steps) > shown else "")


class LeaseLost(Exception):
    """This worker's attempt no longer owns the job; stop without writing anything more."""


class CheckpointQuotaExceeded(TrainerError):
    """A checkpoint was not kept: with it the project's checkpoints would exceed
    GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT. Raised out of the trainer's save, it fails the job."""

    reason = checkpoint_quota.ERROR_CODE


class _OverQuota(Exception):
    """Rolls back a checkpoint's transaction (its row, its retention's marks) over the quota."""

    def __init__(self, use: StorageUse) -> None:
        super().__init__("checkpoint storage quota exceeded")
        self.use = use


def _finite(metrics: dict[str, float]) -> dict[str, float | None]:
    """JSON has no NaN/inf; store them as null so every reader can parse the row."""
    return {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}


class DatabaseCallbacks(Callbacks):
    # The worker deletes the checkpoints the job's retention does not keep (worker.retention),
    # so the trainer deletes none.
    applies_retention = True

    def __init__(
        self,
        ctx: WorkerContext,
        job_id: str,
        attempt: int,
        lease: LeaseKeeper,
        exports: Exports | None = None,
        retention: CheckpointSpec | None = None,
    ) -> None:
        self._ctx = ctx
        self.job_id = job_id
        self.attempt = attempt
        self.lease = lease
        self.exports = exports or Exports()
        # The job spec's checkpoint section (None: every checkpoint is kept); the runner sets
        # it once the spec is loaded.
        self.retention = retention
        self.stop_reason: StopReason | None = None
        self.last_checkpoint_step: int | None = None
        self._project_id: str | None = None

    # -- plumbing --------------------------------------------------------------------------

    def _fenced(self, what: str, progress: dict[str, Any], write: Any = None) -> None:
        """Update the job row (fenced) and, only if it matched, run `write(session)`."""

        def work() -> None:
            # Each hook is its own task boundary: the fencing update and what it guards commit
            # together, or neither does.
            with session_scope(self._ctx.sessions) as session:
                # The fencing update always writes the heartbeat: any write is proof of life.
                values = {"heartbeat_at": utcnow(), **progress}
                if not jobs_repo.update_progress(
                    session, job_id=self.job_id, attempt=self.attempt, values=values
                ):
                    raise LeaseLost(f"job {self.job_id} attempt {self.attempt} lost its lease")
                if write is not None:
                    write(session)

        with_db_retry(work, budget_s=self._ctx.settings.db_retry_seconds, what=what)
        self._ctx.tail.notify(self.job_id, what)

    # -- trainer hooks ---------------------------------------------------------------------

    def on_start(self, info: RunInfo) -> None:
        def write(session: Session) -> None:
            resumed = f", resumed from step {info.start_step}" if info.resumed_from else ""
            add_event(
                session,
                self.job_id,
                "started",
                f"training started on {info.device} with {info.engine} rollouts{resumed}",
                attempt=self.attempt,
                data={"start_step": info.start_step, "total_steps": info.total_steps},
            )

        self._fenced(
            "on_start",
            {
                "total_steps": info.total_steps,
                "current_step": info.start_step,
                "run_started_step": info.start_step,
                "step_started_at": utcnow(),
            },
            write,
        )
        self._remove_deleted_folders()

    def _remove_deleted_folders(self) -> None:
        """Remove the folders of checkpoints marked deleted that are still on disk: a worker
        that died between marking and removing them left them behind."""

        def read() -> list[str]:
            with session_scope(self._ctx.sessions) as session:
                return checkpoints_repo.deleted_paths(session, job_id=self.job_id)

        paths = with_db_retry(read, budget_s=self._ctx.settings.db_retry_seconds, what="cleanup")
        remove_folders(self._ctx.settings.resolved_checkpoint_dir, self.job_id, paths)

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        values = _finite(metrics)
        stored = False

        def write(session: Session) -> None:
            nonlocal stored
            stored = progress_repo.add_metrics_once(
                session,
                job_id=self.job_id,
                step=step,
                attempt=self.attempt,
                values=values,
                now=utcnow(),
            )

        self._fenced(
            "on_step", {"current_step": step, "last_metrics": values, "updated_at": utcnow()}, write
        )
        if stored:  # a step a resumed run repeats was exported with its first values
            self.exports.add_step(step, values)
        self.report_exports(self.exports.take_reports())

    def report_exports(self, reports: list[Report]) -> None:
        """One ``export_failed`` warning event per report of what a tracker did not get."""
        for report in reports:
            self.on_event("export_failed", report.message, level="warning", data=report.data)

    def on_event(
        self, kind: str, message: str, level: str = "info", data: dict[str, object] | None = None
    ) -> None:
        def write(session: Session) -> None:
            add_event(
                session,
                self.job_id,
                kind,
                message,
                attempt=self.attempt,
                level=level,
                data=dict(data) if data else None,
            )

        self._fenced("on_event", {}, write)

    def on_samples(self, step: int, samples: list[RolloutSample]) -> None:
        # The trainer already sends `sample_groups_per_step` groups (train(sample_groups=...)).
        if not samples:
            return
        data = [dataclasses.asdict(s) for s in samples]

        def write(session: Session) -> None:
            progress_repo.add_samples_once(
                session,
                job_id=self.job_id,
                step=step,
                attempt=self.attempt,
                data=data,
                now=utcnow(),
            )

        self._fenced("on_samples", {}, write)

    def _project(self, session: Session) -> str:
        if self._project_id is None:
            self._project_id = jobs_repo.project_of(session, job_id=self.job_id) or ""
        return self._project_id

    def on_checkpoint(self, step: int, path: Path) -> None:
        size = folder_bytes(path)
        doomed: list[tuple[int, str]] = []
        limit = self._ctx.settings.max_checkpoint_bytes_per_project

        def write(session: Session) -> None:
            new = progress_repo.checkpoint_at(session, job_id=self.job_id, step=step) is None
            doomed[:] = record_checkpoint(
                session,
                job_id=self.job_id,
                step=step,
                attempt=self.attempt,
                path=path,
                size_bytes=size,
                retention=self.retention,
                now=utcnow(),
            )
            over = checkpoint_quota.check_recorded(
                session, project_id=self._project(session), limit=limit
            )
            if over is not None:
                raise _OverQuota(over)
            if new:  # the webhook outbox row commits with the checkpoint row
                record_job_event(session, self.job_id, CHECKPOINT_EVENT, step=step)
            deleted = sorted(s for s, _ in doomed)
            gone = f"; deleted the checkpoints of steps {_steps(deleted)}" if deleted else ""
            add_event(
                session,
                self.job_id,
                "checkpoint",
                f"checkpoint of step {step} saved{gone}",
                attempt=self.attempt,
                # No path: events are shown to the job's owner, paths are the server's.
                data={"step": step, "bytes": size}
                | ({"deleted_steps": deleted[:100]} if deleted else {}),
            )

        try:
            self._fenced("on_checkpoint", {}, write)
        except _OverQuota as refused:
            self._refuse_checkpoint(step, path, size, refused.use)
        self.last_checkpoint_step = step
        # Committed: the rows say deleted, so their folders go now (a crash here leaves them
        # to the next attempt's start or the job's purge, invisible to the API meanwhile).
        remove_folders(
            self._ctx.settings.resolved_checkpoint_dir, self.job_id, [p for _, p in doomed]
        )

    def _refuse_checkpoint(
        self, step: int, path: Path, size: int, would_use: StorageUse
    ) -> NoReturn:
        """The checkpoint of `step` took the project over its storage quota and its transaction
        was rolled back: record why (an error event), remove its folder, and end the run with
        CheckpointQuotaExceeded (the runner fails the job with the same message)."""
        message = ""

        def write(session: Session) -> None:
            nonlocal message
            # A row of this step from an earlier save points at the folder just replaced.
            checkpoints_repo.mark_deleted(session, job_id=self.job_id, steps=[step], now=utcnow())
            stored = checkpoint_quota.use_of(
                session, project_id=self._project(session), limit=would_use.limit_bytes or 0
            )
            kept, _ = progress_repo.checkpoints_before(
                session, job_id=self.job_id, before_step=None, limit=1
            )
            last_kept = kept[0].step if kept else None
            message = checkpoint_quota.refusal_message(
                step=step, size=size, would_use=would_use, stored=stored, last_kept=last_kept
            )
            add_event(
                session,
                self.job_id,
                checkpoint_quota.ERROR_CODE,
                message,
                attempt=self.attempt,
                level="error",
                data={
                    "step": step,
                    "bytes": size,
                    "setting": checkpoint_quota.SETTING,
                    "limit_bytes": would_use.limit_bytes,
                    "used_bytes": stored.used_bytes,
                    "used_bytes_with_checkpoint": would_use.used_bytes,
                    "pending_purge_bytes": stored.pending_purge_bytes,
                    "last_kept_step": last_kept,
                },
            )

        self._fenced("on_checkpoint", {}, write)
        remove_folders(self._ctx.settings.resolved_checkpoint_dir, self.job_id, [str(path)])
        raise CheckpointQuotaExceeded(message)

    def should_stop(self) -> bool:
        # The heartbeat process's reports first (it may have seen a SIGTERM this process's own
        # handler could not run for), then one fenced beat of our own: the process beats every
        # few seconds, this asks the database now, so a cancel takes effect at the very next
        # step boundary. A failed beat (database down) does not stop; the process keeps trying.
        self.lease.refresh()
        with contextlib.suppress(Exception):
            self.lease.beat()
        if self.lease.lost.is_set():
            self.stop_reason = "lease_lost"
        elif self.lease.cancel_requested.is_set():
            self.stop_reason = "cancelled"
        elif self.lease.pause_requested.is_set():
            self.stop_reason = "paused"
        elif self._ctx.shutdown.is_set() or self.lease.shutdown_requested.is_set():
            self.stop_reason = "shutdown"
        return self.stop_reason is not None
