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
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from app.core.clock import as_utc, utcnow
from app.core.db import session_scope
from app.core.errors import NotFound
from app.core.settings import Settings
from app.tinker import repository as repo

# How often a held poll reads its request again.
POLL_INTERVAL_S = 0.05
# A model waiting this long for a worker is reported as waiting for capacity (an idle worker
# takes one within a second or two; another session's worker adopts it after 5 s).
UNCLAIMED_NOTICE_S = 15.0


@dataclass(frozen=True)
class Outcome:
    """What retrieve_future answers: ``payload`` bytes in ``media`` (the call's result, or a
    JSON error), or nothing yet (``payload`` None: try again; ``waiting`` says why, when the
    call waits for a worker to take its model)."""

    payload: bytes | None
    media: str = "application/json"
    waiting: str | None = None


PROTOBUF = "application/x-protobuf"


def _read(db: Session, settings: Settings, project_id: str, request_id: str) -> Outcome:
    row = repo.get_request(db, project_id=project_id, request_id=request_id)
    if row is None:
        raise NotFound(f"no Tinker request {request_id[:120]!r}", param="request_id")
    waiting = None
    if row.status == "queued":
        waiting = _unclaimed(db, settings, row.model_id)
        _fail_if_worker_lost(db, settings, row.model_id)
        db.refresh(row)
    if row.status == "done" and row.result is not None:
        return Outcome(row.result, PROTOBUF if row.result_format == "proto" else "application/json")
    if row.status == "failed":
        error = {
            "error": row.error or "the call failed",
            "category": row.error_category or "server",
        }
        return Outcome(json.dumps(error).encode())
    return Outcome(None, waiting=waiting)


def _unclaimed(db: Session, settings: Settings, model_id: str) -> str | None:
    """Why the model's calls wait, when no worker has taken it for a while; a model left
    unclaimed past the claim timeout is failed here (its calls with it, just after)."""
    model = db.get(repo.TinkerModel, model_id)
    if model is None or model.status != "starting" or model.heartbeat_at is not None:
        return None
    now = utcnow()
    created = as_utc(model.created_at) or now
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
    if model is None:
        return
    now = utcnow()
    if model.status in ("starting", "ready"):
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

    def read() -> Outcome:
        with session_scope(sessions) as db:
            return _read(db, settings, project_id, request_id)

    while True:
        outcome = await asyncio.to_thread(read)
        if outcome.payload is not None or time.monotonic() >= deadline:
            return outcome
        await asyncio.sleep(POLL_INTERVAL_S)
