"""The trainer's callbacks, implemented against the database.

Every write is fenced by the attempt number: it first updates the job row `WHERE attempt =
:attempt AND status IN (running, cancelling)`, and only when that matched does it insert metrics,
samples, events or checkpoints, all in one transaction. A worker that lost its lease therefore
writes nothing, and a step written twice (a resumed run repeating a step) is ignored by the
unique (job, step) keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Any

from sqlalchemy import insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.clock import utcnow
from app.db import session_scope
from app.models import Checkpoint, JobMetric, JobSample
from app.repositories import jobs as jobs_repo
from app.transitions import add_event
from trainer.callbacks import Callbacks, RolloutSample, RunInfo
from worker.context import WorkerContext
from worker.lease import LeaseKeeper
from worker.retry import with_db_retry


class LeaseLost(Exception):
    """This worker's attempt no longer owns the job; stop without writing anything more."""


def _insert_ignore(session: Session, model: type[Any], row: dict[str, Any]) -> None:
    """INSERT ... ON CONFLICT DO NOTHING on the unique (job_id, step) key."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        stmt: Any = postgresql.insert(model).values(**row).on_conflict_do_nothing()
    elif dialect == "sqlite":
        stmt = sqlite.insert(model).values(**row).on_conflict_do_nothing()
    else:  # pragma: no cover - other databases are not supported
        stmt = insert(model).values(**row)
    session.execute(stmt)


def _finite(metrics: dict[str, float]) -> dict[str, float | None]:
    """JSON has no NaN/inf; store them as null so every reader can parse the row."""
    return {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}


class DatabaseCallbacks(Callbacks):
    def __init__(self, ctx: WorkerContext, job_id: str, attempt: int, lease: LeaseKeeper) -> None:
        self._ctx = ctx
        self.job_id = job_id
        self.attempt = attempt
        self._lease = lease
        self.stop_reason: str | None = None

    # -- plumbing --------------------------------------------------------------------------

    def _fenced(self, what: str, progress: dict[str, Any], write: Any = None) -> None:
        """Update the job row (fenced) and, only if it matched, run `write(session)`."""

        def work() -> None:
            with session_scope(self._ctx.sessions) as session:
                # The fencing update always writes the heartbeat: any write is proof of life.
                values = {"heartbeat_at": utcnow(), **progress}
                if not jobs_repo.update_progress(session, self.job_id, self.attempt, values):
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

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        values = _finite(metrics)

        def write(session: Session) -> None:
            _insert_ignore(
                session,
                JobMetric,
                {
                    "job_id": self.job_id,
                    "step": step,
                    "attempt": self.attempt,
                    "values": values,
                    "created_at": utcnow(),
                },
            )

        self._fenced(
            "on_step", {"current_step": step, "last_metrics": values, "updated_at": utcnow()}, write
        )

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
        keep = samples[: self._ctx.settings.sample_groups_per_step]
        if not keep:
            return
        data = [dataclasses.asdict(s) for s in keep]

        def write(session: Session) -> None:
            _insert_ignore(
                session,
                JobSample,
                {
                    "job_id": self.job_id,
                    "step": step,
                    "attempt": self.attempt,
                    "data": data,
                    "created_at": utcnow(),
                },
            )

        self._fenced("on_samples", {}, write)

    def on_checkpoint(self, step: int, path: Path) -> None:
        def write(session: Session) -> None:
            _insert_ignore(
                session,
                Checkpoint,
                {
                    "job_id": self.job_id,
                    "step": step,
                    "attempt": self.attempt,
                    "path": str(path),
                    "created_at": utcnow(),
                },
            )
            add_event(
                session,
                self.job_id,
                "checkpoint",
                f"checkpoint of step {step} saved",
                attempt=self.attempt,
                data={"step": step, "path": str(path)},
            )

        self._fenced("on_checkpoint", {}, write)

    def should_stop(self) -> bool:
        # Ask the database now rather than trusting the last heartbeat, so a cancel takes
        # effect at the very next step boundary. A failed read (database down) does not stop.
        with contextlib.suppress(Exception):  # the heartbeat thread keeps trying
            self._lease.beat()
        if self._lease.lost.is_set():
            self.stop_reason = "lease_lost"
        elif self._lease.cancel_requested.is_set():
            self.stop_reason = "cancelled"
        elif self._ctx.shutdown.is_set():
            self.stop_reason = "shutdown"
        return self.stop_reason is not None
