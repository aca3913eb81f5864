"""The queries of a Tinker training model's worker (worker/tinker_model.py): its lease on
the ``tinker_models`` row, the queue of its requests, their results and its saves.

Every write of a held model is fenced by ``lease_owner``: a worker whose lease was taken from it
(its heartbeat went stale and the API marked the model lost, app.tinker.futures) changes
nothing any more. The reads and writes the API shares (failing a model's queued calls, a
sampler, a checkpoint) are app.tinker.repository's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, exists, func, select, update
from sqlalchemy.orm import Session

from app.core.clock import as_utc
from app.core.tinker_tables import TinkerCheckpoint, TinkerModel, TinkerRequest, TinkerSession
from app.tinker import repository as repo
from app.tinker.states import LIVE_MODEL_STATUSES, ModelStatus, RequestStatus
from app.tinker.status_repository import finish_requests, move_model

# The model statuses a worker holds a lease in.
HELD = LIVE_MODEL_STATUSES


def _matched(result: Any) -> int:
    return int(getattr(result, "rowcount", 0) or 0)


@dataclass(frozen=True)
class ModelRef:
    """What a worker's loop needs of a held model's row (read once, at the claim); ``owner``
    is the lease owner, the worker's name."""

    id: str
    session_id: str
    project_id: str
    base_model: str
    owner: str


def claim(db: Session, *, model_id: str, owner: str, now: datetime, stale_before: datetime) -> bool:
    """Take the lease of a model no worker holds yet (or whose worker stopped beating before it
    finished loading): one fenced update, so of two workers sent the same model one wins."""
    result = db.execute(
        update(TinkerModel)
        .where(
            TinkerModel.id == model_id,
            TinkerModel.status == ModelStatus.STARTING,
            (TinkerModel.lease_owner.is_(None)) | (TinkerModel.heartbeat_at < stale_before),
        )
        .values(lease_owner=owner, heartbeat_at=now)
    )
    return _matched(result) == 1


def project_may_use(
    db: Session,
    *,
    project_id: str,
    owner: str,
    stale_before: datetime,
    max_workers: int,
) -> bool:
    """Whether worker ``owner`` may hold one more of the project's models: it holds one
    already, or the project's models are held by fewer than ``max_workers`` live workers
    (GRPO_TINKER_MAX_WORKERS_PER_PROJECT). Two workers deciding at once may pass the bound by
    one until one of them releases its model."""
    holders = set(
        db.scalars(
            select(TinkerModel.lease_owner)
            .where(
                TinkerModel.project_id == project_id,
                TinkerModel.status.in_(HELD),
                TinkerModel.lease_owner.is_not(None),
                TinkerModel.heartbeat_at >= stale_before,
            )
            .distinct()
        )
    )
    return owner in holders or len(holders) < max_workers


def waiting_models(
    db: Session,
    *,
    session_id: str,
    project_id: str,
    stale_before: datetime,
    unclaimed_before: datetime,
    limit: int,
) -> list[str]:
    """Models no worker holds yet (``starting``, no live lease): the session's and the
    project's own at once and first, another project's once it has waited since
    ``unclaimed_before`` (no idle worker took it: this one may), the longest waiting first."""
    since = repo.queued_since()
    query = (
        select(TinkerModel.id)
        .where(
            TinkerModel.status == ModelStatus.STARTING,
            (TinkerModel.lease_owner.is_(None)) | (TinkerModel.heartbeat_at < stale_before),
            (TinkerModel.session_id == session_id)
            | (TinkerModel.project_id == project_id)
            | (since < unclaimed_before),
        )
        # The session's own first (they belong with it), then the project's, then the longest
        # waiting.
        .order_by(TinkerModel.session_id != session_id, TinkerModel.project_id != project_id, since)
        .limit(limit)
    )
    return list(db.scalars(query))


def models_to_send(db: Session, *, sent_before: datetime, limit: int) -> list[str]:
    """Models waiting for a worker (``starting``, never claimed since they were queued) whose
    last message is older than ``sent_before``: a worker deferred it for a job, refused it
    for its project's bound, or the broker lost it."""
    query = (
        select(TinkerModel.id)
        .where(
            TinkerModel.status == ModelStatus.STARTING,
            TinkerModel.lease_owner.is_(None),
            func.coalesce(TinkerModel.dispatched_at, TinkerModel.created_at) < sent_before,
        )
        .order_by(repo.queued_since())
        .limit(limit)
    )
    return list(db.scalars(query))


def mark_sent(db: Session, *, model_id: str, now: datetime) -> None:
    db.execute(
        update(TinkerModel)
        .where(TinkerModel.id == model_id)
        .values(dispatched_at=now)
        .execution_options(synchronize_session=False)
    )


def renew(db: Session, *, model_id: str, owner: str, now: datetime) -> bool:
    """One heartbeat; False once the lease is no longer ours (taken over, or the model ended
    elsewhere: whoever ended it answers its calls)."""
    result = db.execute(
        update(TinkerModel)
        .where(
            TinkerModel.id == model_id,
            TinkerModel.lease_owner == owner,
            TinkerModel.status.in_(HELD),
        )
        .values(heartbeat_at=now)
    )
    return _matched(result) == 1


def session_end(db: Session, *, session_id: str, stale_before: datetime) -> str | None:
    """Why the client's session is over (finished, or silent since before ``stale_before``),
    or None while it lives."""
    row = db.execute(
        select(TinkerSession.finished_at, TinkerSession.heartbeat_at).where(
            TinkerSession.id == session_id
        )
    ).one_or_none()
    if row is None:
        return "deleted"
    if row.finished_at is not None:
        return "finished by the client"
    heartbeat = as_utc(row.heartbeat_at)
    if heartbeat is None or heartbeat < stale_before:
        return "no heartbeat from the client within the session TTL"
    return None


def mark_ready(db: Session, *, model_id: str, owner: str, model_folder: str) -> bool:
    """The model is resident: ready, with the folder it was loaded from (get_info names it)."""
    return move_model(
        db,
        model_id=model_id,
        to=ModelStatus.READY,
        where=[TinkerModel.lease_owner == owner],
        values={"model_folder": model_folder},
    )


def end_model(
    db: Session,
    *,
    model_id: str,
    owner: str,
    status: ModelStatus,
    message: str,
    category: str,
    now: datetime,
) -> bool:
    """End a held model (``closed`` or ``failed``) and fail its queued calls with ``message``.
    The model row is updated first: its row lock makes a concurrent submission that locks the
    model (app.tinker.service) wait and then see the model ended."""
    failed = status == ModelStatus.FAILED
    if not move_model(
        db,
        model_id=model_id,
        to=status,
        from_=HELD,
        where=[TinkerModel.lease_owner == owner],
        values={"error_message": message if failed else None},
    ):
        return False
    repo.fail_queued(db, model_id=model_id, error=message, category=category, now=now)
    return True


def last_call_at(db: Session, *, model_id: str) -> datetime | None:
    """When the model's last call was accepted or settled (what an idle release is fenced by)."""
    return db.scalar(select(TinkerModel.last_request_at).where(TinkerModel.id == model_id))


def release(
    db: Session, *, model_id: str, owner: str, idle_state: str, last_call: datetime | None
) -> bool:
    """An idle model written to ``idle_state`` gives up its worker: ``released``, no lease.
    Fenced by the lease, by ``last_call`` (read before the model was written: a call accepted
    since changed it, under the row's lock, app.tinker.service.accept_request) and by an
    empty queue; False when any failed: the model keeps serving."""
    queued = exists().where(
        TinkerRequest.model_id == model_id, TinkerRequest.status == RequestStatus.QUEUED
    )
    return move_model(
        db,
        model_id=model_id,
        to=ModelStatus.RELEASED,
        from_=[ModelStatus.READY],
        where=[
            TinkerModel.lease_owner == owner,
            TinkerModel.last_request_at == last_call,
            ~queued,
        ],
        values={"lease_owner": None, "heartbeat_at": None, "idle_state": idle_state},
        synchronize=False,
    )


def idle_state_of(db: Session, *, model_id: str) -> str | None:
    """The folder the model was last released to, if any."""
    return db.scalar(select(TinkerModel.idle_state).where(TinkerModel.id == model_id))


@dataclass(frozen=True)
class QueuedRequest:
    position: int
    request_id: str
    kind: str
    body: bytes


def next_request(db: Session, *, model_id: str) -> QueuedRequest | None:
    """The model's oldest queued call (arrival order: the SDK sends one call of a model at a
    time, in seq_id order)."""
    row = db.execute(
        select(
            TinkerRequest.position, TinkerRequest.request_id, TinkerRequest.kind, TinkerRequest.body
        )
        .where(TinkerRequest.model_id == model_id, TinkerRequest.status == RequestStatus.QUEUED)
        .order_by(TinkerRequest.position)
        .limit(1)
    ).one_or_none()
    if row is None:
        return None
    return QueuedRequest(row.position, row.request_id, row.kind, bytes(row.body))


def _held_by(model_id: str, owner: str) -> Any:
    return exists().where(
        TinkerModel.id == model_id,
        TinkerModel.lease_owner == owner,
        TinkerModel.status.in_(HELD),
    )


def settle(
    db: Session,
    *,
    model_id: str,
    owner: str,
    position: int,
    now: datetime,
    result: bytes | None = None,
    result_format: str | None = None,
    error: str | None = None,
    category: str | None = None,
) -> bool:
    """Write a call's outcome (a result, or an error and its category), fenced by the lease;
    False when the lease is gone or the call was already ended elsewhere."""
    # The body is dropped once applied (app.tinker.storage): the result is what stays.
    values: dict[str, Any] = {"finished_at": now, "body": None}
    if error is None:
        to = RequestStatus.DONE
        values.update(result=result, result_format=result_format, stored_bytes=len(result or b""))
    else:
        to = RequestStatus.FAILED
        values.update(error=error, error_category=category, stored_bytes=0)
    where = [TinkerRequest.position == position, _held_by(model_id, owner)]
    if finish_requests(db, to=to, where=where, values=values) != 1:
        return False
    db.execute(update(TinkerModel).where(TinkerModel.id == model_id).values(last_request_at=now))
    return True


def record_checkpoint(
    db: Session,
    *,
    model_id: str,
    project_id: str,
    kind: str,
    name: str,
    folder: str,
    size_bytes: int,
    user_metadata: dict[str, Any] | None,
    now: datetime,
    expires_at: datetime | None,
) -> None:
    """Insert or replace (an overwrite) the row of a save the worker just wrote."""
    row = db.get(TinkerCheckpoint, (model_id, kind, name))
    if row is None:
        row = TinkerCheckpoint(model_id=model_id, kind=kind, name=name, project_id=project_id)
        db.add(row)
    row.folder = folder
    row.size_bytes = size_bytes
    row.user_metadata = user_metadata
    row.created_at = now
    row.expires_at = expires_at
    db.flush()


def set_last_saved(db: Session, *, model_id: str, owner: str, path: str) -> None:
    """The model's newest saved state: what a failure message tells the client to restore."""
    db.execute(
        update(TinkerModel)
        .where(TinkerModel.id == model_id, TinkerModel.lease_owner == owner)
        .values(last_saved_path=path)
    )


def base_model_of(db: Session, *, project_id: str, model_id: str) -> str | None:
    model = repo.get_model(db, project_id=project_id, model_id=model_id)
    return model.base_model if model is not None else None


def expired_saves(db: Session, *, now: datetime, limit: int) -> list[TinkerCheckpoint]:
    """Saves past their expiry (a TTL, or a delete), oldest first: their folders to remove."""
    query = (
        select(TinkerCheckpoint)
        .where(TinkerCheckpoint.expires_at.is_not(None), TinkerCheckpoint.expires_at <= now)
        .order_by(TinkerCheckpoint.expires_at)
        .limit(limit)
    )
    return list(db.scalars(query))


def forget_save(db: Session, *, model_id: str, kind: str, name: str, expired_by: datetime) -> bool:
    """Delete an expired save's row before its folder is removed; False (nothing deleted) when
    it was written again meanwhile (an overwrite gives it a new expiry)."""
    result = db.execute(
        delete(TinkerCheckpoint).where(
            TinkerCheckpoint.model_id == model_id,
            TinkerCheckpoint.kind == kind,
            TinkerCheckpoint.name == name,
            TinkerCheckpoint.expires_at.is_not(None),
            TinkerCheckpoint.expires_at <= expired_by,
        )
    )
    return _matched(result) == 1
