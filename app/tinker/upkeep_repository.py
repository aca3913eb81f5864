"""The queries of the Tinker API's upkeep (worker.tinker_upkeep, and the reads app.tinker.futures
marks): stored calls bounded (app.tinker.storage says how), released models of ended sessions
closed, idle folders forgotten, waiting models sent again."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, or_, select, update
from sqlalchemy.orm import Session

from app.core.tinker_tables import TinkerModel, TinkerRequest, TinkerSession
from app.tinker.states import ENDED_MODEL_STATUSES, ModelStatus, RequestStatus
from app.tinker.status_repository import move_model

# A result read by the client stays this long (the answer to a poll may be lost on the way and
# the SDK polls again); then it is dropped.
RESULT_GRACE_S = 60.0
# Rows one sweep changes at most (the rest wait for the next pass).
SWEEP_BATCH = 500


def _matched(result: object) -> int:
    return int(getattr(result, "rowcount", 0) or 0)


def mark_retrieved(db: Session, *, request_id: str, now: datetime) -> None:
    """The client read the request's result: it is dropped ``RESULT_GRACE_S`` later."""
    db.execute(
        update(TinkerRequest)
        .where(TinkerRequest.request_id == request_id, TinkerRequest.retrieved_at.is_(None))
        .values(retrieved_at=now)
        .execution_options(synchronize_session=False)
    )


def drop_results(db: Session, *, now: datetime, retention_s: float) -> int:
    """Drop the results read more than ``RESULT_GRACE_S`` ago and those nobody read within
    ``retention_s``; how many."""
    read_before = now - timedelta(seconds=RESULT_GRACE_S)
    unread_before = now - timedelta(seconds=retention_s)
    due = select(TinkerRequest.position).where(
        TinkerRequest.result.is_not(None),
        or_(
            TinkerRequest.retrieved_at < read_before,
            TinkerRequest.finished_at < unread_before,
        ),
    )
    positions = list(db.scalars(due.limit(SWEEP_BATCH)))
    if not positions:
        return 0
    db.execute(
        update(TinkerRequest)
        .where(TinkerRequest.position.in_(positions))
        .values(result=None, stored_bytes=0)
        .execution_options(synchronize_session=False)
    )
    return len(positions)


def ended_sessions(db: Session, *, ended_before: datetime, limit: int) -> list[str]:
    """Sessions finished, or silent, since before ``ended_before`` that still have call rows."""
    has_calls = (
        select(TinkerRequest.position)
        .join(TinkerModel, TinkerModel.id == TinkerRequest.model_id)
        .where(TinkerModel.session_id == TinkerSession.id)
        .exists()
    )
    query = (
        select(TinkerSession.id)
        .where(
            or_(
                TinkerSession.finished_at < ended_before,
                TinkerSession.heartbeat_at < ended_before,
            ),
            has_calls,
        )
        .limit(limit)
    )
    return list(db.scalars(query))


def delete_calls_of_session(db: Session, *, session_id: str) -> int:
    """Delete the call rows of an ended session's models; how many."""
    models = select(TinkerModel.id).where(TinkerModel.session_id == session_id)
    result = db.execute(
        delete(TinkerRequest)
        .where(TinkerRequest.model_id.in_(models))
        .execution_options(synchronize_session=False)
    )
    return _matched(result)


def released_of_ended_sessions(
    db: Session, *, ended_before: datetime, limit: int
) -> list[tuple[str, str]]:
    """(model id, idle folder) of released models whose session finished, or went silent
    before ``ended_before``."""
    query = (
        select(TinkerModel.id, TinkerModel.idle_state)
        .join(TinkerSession, TinkerSession.id == TinkerModel.session_id)
        .where(
            TinkerModel.status == ModelStatus.RELEASED,
            (TinkerSession.finished_at.is_not(None)) | (TinkerSession.heartbeat_at < ended_before),
        )
        .limit(limit)
    )
    return [(str(model_id), str(folder or "")) for model_id, folder in db.execute(query)]


def close_released(db: Session, *, model_id: str) -> bool:
    """Close a released model (its session is over); False when it was called again meanwhile."""
    return move_model(
        db,
        model_id=model_id,
        to=ModelStatus.CLOSED,
        from_=[ModelStatus.RELEASED],
        values={"idle_state": None},
        synchronize=False,
    )


def idle_states_of_ended(db: Session, *, limit: int) -> list[tuple[str, str]]:
    """(model id, idle folder) of models that ended (closed or failed) with one recorded."""
    query = (
        select(TinkerModel.id, TinkerModel.idle_state)
        .where(TinkerModel.status.in_(ENDED_MODEL_STATUSES), TinkerModel.idle_state.is_not(None))
        .limit(limit)
    )
    return [(str(model_id), str(folder)) for model_id, folder in db.execute(query)]


def forget_idle_state(db: Session, *, model_id: str) -> None:
    db.execute(
        update(TinkerModel)
        .where(TinkerModel.id == model_id)
        .values(idle_state=None)
        .execution_options(synchronize_session=False)
    )


def requeue_released_with_calls(db: Session, *, now: datetime, limit: int) -> list[str]:
    """Put released models that have calls waiting back in the queue (``starting``, their last
    message forgotten so that the next resend pass sends them); their ids."""
    queued = (
        select(TinkerRequest.position)
        .where(
            TinkerRequest.model_id == TinkerModel.id, TinkerRequest.status == RequestStatus.QUEUED
        )
        .exists()
    )
    ids = list(
        db.scalars(
            select(TinkerModel.id)
            .where(TinkerModel.status == ModelStatus.RELEASED, queued)
            .limit(limit)
        )
    )
    for model_id in ids:
        move_model(
            db,
            model_id=model_id,
            to=ModelStatus.STARTING,
            from_=[ModelStatus.RELEASED],
            values={"queued_at": now, "dispatched_at": None},
            synchronize=False,
        )
    return ids
