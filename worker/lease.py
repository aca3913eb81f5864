"""The lease of a running job attempt, as the worker process holds it.

- `LeaseKeeper`: what the trainer's `should_stop` reads (lease lost, cancel or pause requested,
  shutdown requested). Entering it starts the heartbeat process (`worker.heartbeat`), which keeps the
  lease from outside this process, so a trainer holding the GIL cannot starve it; its reports
  and a synchronous fenced beat at each step boundary (`beat`) set the flags.

How an attempt ends (`end_attempt`, `pause`, `release`) is in `worker.attempts`.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import Session, sessionmaker

from app.core.db import session_scope
from app.jobs import repository as jobs_repo
from app.jobs.transitions import JobStatus
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
