"""The lease a worker holds on a Tinker training model's row while it serves it
(worker.tinker_model): renewed by a thread, which also watches the client's session.

A thread, not the job runner's heartbeat process: a call runs for seconds in torch, which
releases the GIL, and nothing here runs user code (graders, tools) that could hold it; the API
marks the model lost only after ``lease_seconds`` without a beat.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import Session, sessionmaker

from app.core.clock import utcnow
from app.core.db import session_scope
from app.tinker import repository as repo
from app.tinker import worker_repository as q
from app.tinker.worker_repository import ModelRef
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class ModelLease:
    """The lease on a model's row, renewed by a thread every ``interval_s`` while entered. The
    thread also watches the client's session: ``lost`` is set once a renewal matched no row,
    ``session_over`` (with ``end_reason``) once the session is finished or silent."""

    def __init__(
        self, sessions: sessionmaker[Session], ref: ModelRef, settings: WorkerSettings
    ) -> None:
        self._sessions = sessions
        self._ref = ref
        self._interval = settings.heartbeat_seconds
        self._session_ttl = settings.tinker_session_ttl_s
        self.lost = threading.Event()
        self.session_over = threading.Event()
        self.end_reason = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"tinker-lease-{ref.id}", daemon=True
        )

    def __enter__(self) -> ModelLease:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval) and not self.lost.is_set():
            self.beat()

    def beat(self) -> None:
        """One fenced renewal and a look at the session."""
        now = utcnow()
        try:
            with session_scope(self._sessions) as db:
                held = q.renew(db, model_id=self._ref.id, owner=self._ref.owner, now=now)
                ended = q.session_end(
                    db,
                    session_id=self._ref.session_id,
                    stale_before=repo.stale_since(now, self._session_ttl),
                )
        except Exception as exc:  # the database is down: keep trying, the lease decides
            log.warning("tinker model %s: heartbeat failed: %s", self._ref.id, exc)
            return
        if not held:
            if not self.lost.is_set():
                log.warning("tinker model %s: lease lost", self._ref.id)
            self.lost.set()
        if ended is not None and not self.session_over.is_set():
            self.end_reason = ended
            self.session_over.set()
