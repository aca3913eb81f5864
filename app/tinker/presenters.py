"""A page of a project's Tinker sessions as GET /v1/tinker/sessions shows it: each session with
its newest training clients and the calls each applied (app.tinker.listing_schemas). Reads only:
four queries a page, every one scoped by the project (app.tinker.repository)."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from sqlalchemy.orm import Session

from app.core.clock import as_utc, utcnow
from app.core.errors import NotFound
from app.core.tinker_tables import TinkerModel, TinkerSession
from app.tinker import repository as repo
from app.tinker.listing_schemas import (
    SessionState,
    TinkerModelOut,
    TinkerSessionList,
    TinkerSessionOut,
)
from app.tinker.states import CLIENT_STATUSES, RequestStatus

# Training clients listed per session (the newest); `model_count` says how many it made.
MODELS_PER_SESSION = 20


def session_page(
    db: Session, *, project_id: str, ttl_s: float, after: str | None, limit: int
) -> TinkerSessionList:
    """The project's sessions newest first, ``limit`` at most, after the session ``after`` (a
    404 when that is not one of the project's)."""
    cursor = None
    if after:
        cursor = repo.get_session(db, project_id=project_id, session_id=after)
        if cursor is None:
            raise NotFound(f"no Tinker session {after!r}", param="after")
    rows, has_more = repo.sessions_page(db, project_id=project_id, after=cursor, limit=limit)
    ids = [row.id for row in rows]
    models = repo.newest_models_of_sessions(
        db, project_id=project_id, session_ids=ids, per_session=MODELS_PER_SESSION
    )
    counts = repo.model_counts(db, project_id=project_id, session_ids=ids)
    calls: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
    for model_id, kind, status, n in repo.call_counts(
        db, project_id=project_id, model_ids=[m.id for m in models]
    ):
        calls[model_id][status][kind] = n
    by_session: dict[str, list[TinkerModelOut]] = defaultdict(list)
    for model in models:
        by_session[model.session_id].append(model_out(model, calls[model.id]))
    stale = repo.stale_since(utcnow(), ttl_s)
    return TinkerSessionList(
        data=[
            session_out(row, state_of(row, stale), counts.get(row.id, 0), by_session[row.id])
            for row in rows
        ],
        has_more=has_more,
        next_after=rows[-1].id if rows and has_more else None,
    )


def state_of(row: TinkerSession, stale_before: datetime) -> SessionState:
    """finished (closed by its client), expired (no heartbeat since ``stale_before``) or live:
    the rule app.tinker.service.live_session applies."""
    if row.finished_at is not None:
        return "finished"
    heartbeat = as_utc(row.heartbeat_at)
    return "expired" if heartbeat is None or heartbeat < stale_before else "live"


def session_out(
    row: TinkerSession, state: SessionState, model_count: int, models: list[TinkerModelOut]
) -> TinkerSessionOut:
    return TinkerSessionOut(
        id=row.id,
        display_name=row.display_name,
        tags=[str(tag) for tag in row.tags or []],
        sdk_version=row.sdk_version,
        created_at=as_utc(row.created_at) or utcnow(),
        heartbeat_at=as_utc(row.heartbeat_at) or utcnow(),
        finished_at=as_utc(row.finished_at),
        finish_reason=row.finish_reason,
        status=state,
        live=state == "live",
        model_count=model_count,
        models=models,
    )


def model_out(row: TinkerModel, calls: dict[str, dict[str, int]]) -> TinkerModelOut:
    """``calls``: the model's call counts per status (queued, done, failed), then per kind."""
    applied = calls.get(RequestStatus.DONE, {})
    return TinkerModelOut(
        id=row.id,
        base_model=row.base_model,
        lora_rank=row.lora_rank,
        status=row.status,
        live=row.status in CLIENT_STATUSES,
        created_at=as_utc(row.created_at) or utcnow(),
        last_request_at=as_utc(row.last_request_at) or utcnow(),
        last_saved_path=row.last_saved_path,
        error_message=row.error_message,
        calls_applied=sum(applied.values()),
        calls_failed=sum(calls.get(RequestStatus.FAILED, {}).values()),
        calls_queued=sum(calls.get(RequestStatus.QUEUED, {}).values()),
        applied_by_kind=dict(sorted(applied.items())),
    )
