"""``retrieve_future``: a call's result once its worker wrote it, held open for up to
``GRPO_TINKER_POLL_WAIT_S`` while it is queued (the SDK polls again at once after a
``try_again``; it gives up on a poll after 45 s).

A queued call whose model's worker stopped heartbeating (killed, its machine gone) fails here,
with the others of that model, naming the model's last saved state: a dead worker's calls end
with a clear error instead of waiting forever, and the client restores from that state.

A call whose model no worker has taken yet answers ``try_again`` with ``queue_state``
``paused_capacity`` (the SDK logs that it waits for capacity) once the model waited
``UNCLAIMED_NOTICE_S``; after ``GRPO_TINKER_CLAIM_TIMEOUT_S`` the model and its calls fail,
saying why, and the project's quota is free again.

Held polls are shared fairly: one project holds at most ``GRPO_TINKER_MAX_POLLS_PER_PROJECT``
open in an API process (429 beyond; the SDK retries), and their database reads run on an
executor of their own, so that one tenant's polls never take the threads the other routes
run on. A queued call's re-read fetches its status alone, never its body or result bytes.
A result read is marked retrieved (app.tinker.storage drops it a minute later).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from app.core.clock import as_utc, utcnow
from app.core.db import session_scope
from app.core.errors import NotFound, TooManyRequests
from app.core.settings import Settings
from app.tinker import repository as repo
from app.tinker import upkeep_repository as up
from app.tinker.states import LIVE_MODEL_STATUSES, ModelStatus, RequestStatus

# How often a held poll reads its request again.
POLL_INTERVAL_S = 0.05
# A model waiting this long for a worker is reported as waiting for capacity (an idle worker
# takes one within a second or two; another session's worker adopts it after 5 s).
UNCLAIMED_NOTICE_S = 15.0
# Threads the held polls' reads run on (per API process), apart from the routes' threadpool.
POLL_THREADS = 4
_POLL_EXECUTOR = ThreadPoolExecutor(max_workers=POLL_THREADS, thread_name_prefix="tinker-poll")


@dataclass(frozen=True)
class Outcome:
    """What retrieve_future answers: ``payload`` bytes in ``media`` (the call's result, or a
    JSON error), or nothing yet (``payload`` None: try again; ``waiting`` says why, when the
    call waits for a worker to take its model)."""

    payload: bytes | None
    media: str = "application/json"
    waiting: str | None = None


PROTOBUF = "application/x-protobuf"


class PollSlots:
    """The polls each project holds open in this process, bounded per project."""

    def __init__(self) -> None:
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, project_id: str, limit: int) -> Iterator[None]:
        with self._lock:
            if self._held[project_id] >= limit:
                raise TooManyRequests(
                    f"this project holds {limit} retrieve_future polls open "
                    "(GRPO_TINKER_MAX_POLLS_PER_PROJECT); poll again when one returns",
                    retry_after=1,
                    param="GRPO_TINKER_MAX_POLLS_PER_PROJECT",
                )
            self._held[project_id] += 1
        try:
            yield
        finally:
            with self._lock:
                self._held[project_id] -= 1
                if self._held[project_id] <= 0:
                    del self._held[project_id]


POLLS = PollSlots()


def _request_status(db: Session, project_id: str, request_id: str) -> tuple[str, str]:
    """(status, model id) of the project's request (404 when it is not the project's)."""
    found = repo.request_status(db, project_id=project_id, request_id=request_id)
    if found is None:
        raise NotFound(f"no Tinker request {request_id[:120]!r}", param="request_id")
    return found


def _read(db: Session, settings: Settings, project_id: str, request_id: str) -> Outcome:
    status, model_id = _request_status(db, project_id, request_id)
    waiting = None
    if status == RequestStatus.QUEUED:
        waiting = _unclaimed(db, settings, model_id)
        _fail_if_worker_lost(db, settings, model_id)
        status, _ = _request_status(db, project_id, request_id)
    if status == RequestStatus.QUEUED:
        return Outcome(None, waiting=waiting)
    row = repo.get_request(db, project_id=project_id, request_id=request_id)
    assert row is not None  # read just above; rows of a live session are not deleted
    if row.status == RequestStatus.DONE:
        if row.result is None:  # read before, and dropped after its grace period
            error = {
                "error": f"the result of {request_id} was already retrieved and is no longer "
                "kept (results are dropped a minute after they are read)",
                "category": "user",
            }
            return Outcome(json.dumps(error).encode())
        up.mark_retrieved(db, request_id=request_id, now=utcnow())
        return Outcome(row.result, PROTOBUF if row.result_format == "proto" else "application/json")
    error = {"error": row.error or "the call failed", "category": row.error_category or "server"}
    return Outcome(json.dumps(error).encode())


def _unclaimed(db: Session, settings: Settings, model_id: str) -> str | None:
    """Why the model's calls wait, when no worker has taken it for a while; a model left
    unclaimed past the claim timeout is failed here (its calls with it, just after)."""
    model = db.get(repo.TinkerModel, model_id)
    if model is None or model.status != "starting" or model.heartbeat_at is not None:
        return None
    now = utcnow()
    created = as_utc(model.queued_at or model.created_at) or now
    if created >= repo.stale_since(now, UNCLAIMED_NOTICE_S):
        return None
    timeout = settings.tinker_claim_timeout_s
    cutoff = repo.stale_since(now, timeout)
    # The row as read decides whether to write at all (a poll reads every 50 ms: no write
    # while the model is young); the fenced update decides against a worker's claim.
    if created < cutoff and repo.mark_model_unclaimed(
        db,
        model_id=model_id,
        created_before=cutoff,
        error=(
            f"no worker took training client {model_id} within {timeout:.0f} s (every worker "
            "is busy with jobs or holds as many models as it may); create it again later"
        ),
    ):
        db.refresh(model)  # failed: its calls fail next (_fail_if_worker_lost)
        return None
    return (
        f"no worker has taken training client {model_id} yet (every worker is busy); it waits "
        f"up to {timeout:.0f} s"
    )


def _fail_if_worker_lost(db: Session, settings: Settings, model_id: str) -> None:
    """Fail the model's queued calls when its model ended or its worker's heartbeat is older
    than the lease (``GRPO_LEASE_SECONDS``)."""
    model = db.get(repo.TinkerModel, model_id)
    if (
        model is None or model.status == ModelStatus.RELEASED
    ):  # its calls send it to the queue again
        return
    now = utcnow()
    if model.status in LIVE_MODEL_STATUSES:
        lost = f"the worker holding model {model_id} stopped"
        if model.last_saved_path:
            lost += f"; restore it from {model.last_saved_path}"
        stale = repo.stale_since(now, settings.lease_seconds)
        beat = as_utc(model.heartbeat_at)
        # No write while the heartbeat read is fresh (or the model unclaimed): the fenced
        # update decides only when the row as read says the worker is gone.
        if beat is None or beat >= stale:
            return
        if not repo.mark_model_lost(db, model_id=model_id, stale_before=stale, error=lost):
            return
        db.refresh(model)
    message = model.error_message or f"model {model_id} is {model.status}"
    repo.fail_queued(db, model_id=model_id, error=message, category="server", now=now)


async def await_outcome(
    sessions: sessionmaker[Session], settings: Settings, project_id: str, request_id: str
) -> Outcome:
    """The request's outcome, waiting up to the poll window for a queued one (each read in a
    short unit of work of its own, in a thread: the event loop never blocks on the database)."""
    deadline = time.monotonic() + settings.tinker_poll_wait_s
    loop = asyncio.get_running_loop()

    def read() -> Outcome:
        with session_scope(sessions) as db:
            return _read(db, settings, project_id, request_id)

    with POLLS.hold(project_id, settings.tinker_max_polls_per_project):
        while True:
            outcome = await loop.run_in_executor(_POLL_EXECUTOR, read)
            if outcome.payload is not None or time.monotonic() >= deadline:
                return outcome
            await asyncio.sleep(POLL_INTERVAL_S)
