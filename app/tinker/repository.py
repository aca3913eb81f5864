"""The Tinker API's queries (tables: app.core.tinker_tables). Every read of a tenant's row is
by project, so no call can reach another project's session, model, sampler or request."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.orm import Session

from app.core.tinker_tables import (
    TinkerCheckpoint,
    TinkerModel,
    TinkerRequest,
    TinkerSampler,
    TinkerSession,
)
from app.tinker.states import CLIENT_STATUSES, LIVE_MODEL_STATUSES, ModelStatus, RequestStatus
from app.tinker.status_repository import finish_requests, move_model


def queued_since(model: type[TinkerModel] = TinkerModel) -> ColumnElement[datetime]:
    """When the model last went to the queue (rows from before idle release: created_at)."""
    return func.coalesce(model.queued_at, model.created_at)


def get_session(db: Session, *, project_id: str, session_id: str) -> TinkerSession | None:
    row = db.get(TinkerSession, session_id)
    return row if row is not None and row.project_id == project_id else None


def live_sessions(db: Session, *, project_id: str, since: datetime) -> int:
    """The project's sessions not finished whose last heartbeat is at or after ``since``."""
    query = select(func.count()).where(
        TinkerSession.project_id == project_id,
        TinkerSession.finished_at.is_(None),
        TinkerSession.heartbeat_at >= since,
    )
    return int(db.scalar(query) or 0)


def get_model(db: Session, *, project_id: str, model_id: str) -> TinkerModel | None:
    row = db.get(TinkerModel, model_id)
    return row if row is not None and row.project_id == project_id else None


def lock_model(db: Session, *, project_id: str, model_id: str) -> TinkerModel | None:
    """The model row as it is now, locked until the unit of work ends (Postgres): two calls of
    one model check and advance its ``last_seq`` one after the other, and a call and the
    worker's idle release of the model see each other (app.tinker.service.accept_request)."""
    row = db.scalar(
        select(TinkerModel)
        .where(TinkerModel.id == model_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    return row if row is not None and row.project_id == project_id else None


def live_models(db: Session, *, project_id: str) -> int:
    query = select(func.count()).where(
        TinkerModel.project_id == project_id, TinkerModel.status.in_(CLIENT_STATUSES)
    )
    return int(db.scalar(query) or 0)


def stored_bytes(db: Session, *, project_id: str) -> int:
    """The bytes of the project's calls and results still stored (app.tinker.storage)."""
    total = db.scalar(
        select(func.coalesce(func.sum(TinkerRequest.stored_bytes), 0)).where(
            TinkerRequest.project_id == project_id
        )
    )
    return int(total or 0)


def queued_requests(db: Session, *, model_id: str) -> int:
    query = select(func.count()).where(
        TinkerRequest.model_id == model_id, TinkerRequest.status == RequestStatus.QUEUED
    )
    return int(db.scalar(query) or 0)


def find_request(db: Session, *, model_id: str, seq_key: str) -> TinkerRequest | None:
    query = select(TinkerRequest).where(
        TinkerRequest.model_id == model_id, TinkerRequest.seq_key == seq_key
    )
    return db.scalar(query)


def get_request(db: Session, *, project_id: str, request_id: str) -> TinkerRequest | None:
    row = db.scalar(select(TinkerRequest).where(TinkerRequest.request_id == request_id))
    return row if row is not None and row.project_id == project_id else None


def request_status(db: Session, *, project_id: str, request_id: str) -> tuple[str, str] | None:
    """(status, model id) of the project's request, its payloads left unread (a held poll reads
    this every 50 ms); None when it is not the project's."""
    row = db.execute(
        select(TinkerRequest.status, TinkerRequest.model_id, TinkerRequest.project_id).where(
            TinkerRequest.request_id == request_id
        )
    ).one_or_none()
    if row is None or row.project_id != project_id:
        return None
    return str(row.status), str(row.model_id)


def fail_queued(db: Session, *, model_id: str, error: str, category: str, now: datetime) -> int:
    """Fail every queued request of a model (its worker is gone); how many."""
    return finish_requests(
        db,
        to=RequestStatus.FAILED,
        where=[TinkerRequest.model_id == model_id],
        # The body is dropped with the call: nothing will apply it any more.
        values={
            "error": error,
            "error_category": category,
            "finished_at": now,
            "body": None,
            "stored_bytes": 0,
        },
        synchronize=False,
    )


def mark_model_lost(db: Session, *, model_id: str, stale_before: datetime, error: str) -> bool:
    """Mark a model failed when its worker's heartbeat is older than ``stale_before`` (the
    worker died); False when the heartbeat is fresh or the model already ended."""
    return move_model(
        db,
        model_id=model_id,
        to=ModelStatus.FAILED,
        from_=LIVE_MODEL_STATUSES,
        where=[TinkerModel.heartbeat_at.is_not(None), TinkerModel.heartbeat_at < stale_before],
        values={"error_message": error},
        synchronize=False,
    )


def mark_model_unclaimed(
    db: Session, *, model_id: str, created_before: datetime, error: str
) -> bool:
    """Mark a model failed when no worker claimed it since it went to the queue (created, or
    called again once released), before ``created_before``; False otherwise (a worker took it
    meanwhile, or it is younger)."""
    return move_model(
        db,
        model_id=model_id,
        to=ModelStatus.FAILED,
        from_=[ModelStatus.STARTING],
        where=[TinkerModel.heartbeat_at.is_(None), queued_since() < created_before],
        values={"error_message": error},
        synchronize=False,
    )


def get_sampler(db: Session, *, project_id: str, sampler_id: str) -> TinkerSampler | None:
    row = db.get(TinkerSampler, sampler_id)
    return row if row is not None and row.project_id == project_id else None


def get_checkpoint(
    db: Session, *, project_id: str, model_id: str, kind: str, name: str
) -> TinkerCheckpoint | None:
    row = db.get(TinkerCheckpoint, (model_id, kind, name))
    return row if row is not None and row.project_id == project_id else None


def _not_expired(now: datetime) -> ColumnElement[bool]:
    """A save lives until its ``expires_at`` (its folder may linger until retention removes
    it); one without lives on."""
    return or_(TinkerCheckpoint.expires_at.is_(None), TinkerCheckpoint.expires_at > now)


def live_checkpoint(
    db: Session, *, project_id: str, model_id: str, kind: str, name: str, now: datetime
) -> TinkerCheckpoint | None:
    """The project's save of that name, unless it expired."""
    query = select(TinkerCheckpoint).where(
        TinkerCheckpoint.model_id == model_id,
        TinkerCheckpoint.kind == kind,
        TinkerCheckpoint.name == name,
        TinkerCheckpoint.project_id == project_id,
        _not_expired(now),
    )
    return db.scalars(query).first()


def checkpoints_of_model(
    db: Session, *, project_id: str, model_id: str, now: datetime
) -> list[TinkerCheckpoint]:
    """The model's saves not expired, oldest first."""
    query = (
        select(TinkerCheckpoint)
        .where(TinkerCheckpoint.project_id == project_id, TinkerCheckpoint.model_id == model_id)
        .where(_not_expired(now))
        .order_by(TinkerCheckpoint.created_at)
    )
    return list(db.scalars(query))


def newest_saves(
    db: Session, *, project_id: str, kind: str, now: datetime, limit: int
) -> list[tuple[TinkerCheckpoint, TinkerModel]]:
    """The project's ``limit`` newest saves of ``kind`` not expired, each with the training
    client that wrote it."""
    query = (
        select(TinkerCheckpoint, TinkerModel)
        .join(TinkerModel, TinkerModel.id == TinkerCheckpoint.model_id)
        .where(TinkerCheckpoint.project_id == project_id, TinkerCheckpoint.kind == kind)
        .where(_not_expired(now))
        .order_by(TinkerCheckpoint.created_at.desc(), TinkerCheckpoint.model_id)
        .limit(limit)
    )
    return [(row, model) for row, model in db.execute(query).tuples()]


def saved_bytes(db: Session, *, project_id: str) -> int:
    """The bytes of the project's Tinker saves on disk: every recorded save, expired or deleted
    ones too until a worker removes them (worker.maintenance)."""
    total = db.scalar(
        select(func.coalesce(func.sum(TinkerCheckpoint.size_bytes), 0)).where(
            TinkerCheckpoint.project_id == project_id
        )
    )
    return int(total or 0)


def expire_checkpoint(
    db: Session, *, project_id: str, model_id: str, kind: str, name: str, now: datetime
) -> bool:
    """Mark the project's live save expired now (a delete: a worker removes its folder and
    row); False when there is no such live save."""
    row = live_checkpoint(
        db, project_id=project_id, model_id=model_id, kind=kind, name=name, now=now
    )
    if row is None:
        return False
    row.expires_at = now
    db.flush()
    return True


def stale_since(now: datetime, seconds: float) -> datetime:
    return now - timedelta(seconds=seconds)


# ------------------------------------------------------------------ listing and usage
# (GET /v1/tinker/sessions, app.tinker.listing_routes; the `tinker` part of GET /v1/usage)


def sessions_page(
    db: Session, *, project_id: str, after: TinkerSession | None, limit: int
) -> tuple[list[TinkerSession], bool]:
    """The project's sessions, newest first (ties by id), at most ``limit``; ``after`` is the
    last session of the previous page. Whether more follow."""
    query = select(TinkerSession).where(TinkerSession.project_id == project_id)
    if after is not None:
        query = query.where(
            or_(
                TinkerSession.created_at < after.created_at,
                and_(TinkerSession.created_at == after.created_at, TinkerSession.id < after.id),
            )
        )
    query = query.order_by(TinkerSession.created_at.desc(), TinkerSession.id.desc())
    rows = list(db.scalars(query.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def newest_models_of_sessions(
    db: Session, *, project_id: str, session_ids: list[str], per_session: int
) -> list[TinkerModel]:
    """The newest ``per_session`` training models of each of the sessions, oldest first."""
    if not session_ids:
        return []
    rank = (
        func.row_number()
        .over(
            partition_by=TinkerModel.session_id,
            order_by=(TinkerModel.created_at.desc(), TinkerModel.id.desc()),
        )
        .label("rank")
    )
    ranked = (
        select(TinkerModel.id, rank)
        .where(TinkerModel.project_id == project_id, TinkerModel.session_id.in_(session_ids))
        .subquery()
    )
    query = (
        select(TinkerModel)
        .join(ranked, ranked.c.id == TinkerModel.id)
        .where(ranked.c.rank <= per_session)
        .order_by(TinkerModel.created_at, TinkerModel.id)
    )
    return list(db.scalars(query))


def model_counts(db: Session, *, project_id: str, session_ids: list[str]) -> dict[str, int]:
    """How many training models each of the sessions made (sessions with none left out)."""
    if not session_ids:
        return {}
    query = (
        select(TinkerModel.session_id, func.count())
        .where(TinkerModel.project_id == project_id, TinkerModel.session_id.in_(session_ids))
        .group_by(TinkerModel.session_id)
    )
    return {str(session_id): int(n) for session_id, n in db.execute(query)}


def call_counts(
    db: Session, *, project_id: str, model_ids: list[str]
) -> list[tuple[str, str, str, int]]:
    """The models' calls counted per (model id, kind, status: queued | done | failed)."""
    if not model_ids:
        return []
    query = (
        select(TinkerRequest.model_id, TinkerRequest.kind, TinkerRequest.status, func.count())
        .where(TinkerRequest.project_id == project_id, TinkerRequest.model_id.in_(model_ids))
        .group_by(TinkerRequest.model_id, TinkerRequest.kind, TinkerRequest.status)
    )
    return [(str(m), str(k), str(s), int(n)) for m, k, s, n in db.execute(query)]


def created_since(db: Session, *, project_id: str, since: datetime) -> tuple[int, int]:
    """The sessions and the training models the project created at or after ``since``."""
    sessions = select(func.count()).where(
        TinkerSession.project_id == project_id, TinkerSession.created_at >= since
    )
    models = select(func.count()).where(
        TinkerModel.project_id == project_id, TinkerModel.created_at >= since
    )
    return int(db.scalar(sessions) or 0), int(db.scalar(models) or 0)


def calls_since(db: Session, *, project_id: str, since: datetime) -> list[tuple[str, str, int]]:
    """The project's calls made at or after ``since``, counted per (kind, status), by kind."""
    query = (
        select(TinkerRequest.kind, TinkerRequest.status, func.count())
        .where(TinkerRequest.project_id == project_id, TinkerRequest.created_at >= since)
        .group_by(TinkerRequest.kind, TinkerRequest.status)
        .order_by(TinkerRequest.kind, TinkerRequest.status)
    )
    return [(str(k), str(s), int(n)) for k, s, n in db.execute(query)]
