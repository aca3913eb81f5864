"""The lease of a running job: a heartbeat thread that keeps it, notices a cancel request, and
notices when the lease was taken over (the job's attempt moved on), after which the worker must
stop writing."""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import Session, sessionmaker

from app.db import session_scope
from app.repositories import jobs as jobs_repo
from app.transitions import JobStatus

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(
        self, sessions: sessionmaker[Session], job_id: str, attempt: int, interval_s: float
    ) -> None:
        self._sessions = sessions
        self.job_id = job_id
        self.attempt = attempt
        self._interval = interval_s
        self.lost = threading.Event()
        self.cancel_requested = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{job_id}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval + 5)

    def beat(self) -> None:
        """One heartbeat; sets `lost` or `cancel_requested` from what the database says."""
        with session_scope(self._sessions) as session:
            status = jobs_repo.heartbeat(session, self.job_id, self.attempt)
        if status is None:
            if not self.lost.is_set():
                log.warning("job %s attempt %s lost its lease", self.job_id, self.attempt)
            self.lost.set()
        elif status == JobStatus.CANCELLING:
            self.cancel_requested.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.beat()
            except Exception as exc:  # database down: keep trying, the reaper decides
                log.warning("heartbeat of job %s failed: %s", self.job_id, exc)
            if self.lost.is_set():
                return
