"""The rules of the Tinker API: sessions live while their heartbeats arrive, a project holds a
bounded number of sessions, models and queued calls, a model's training calls are accepted in
``seq_id`` order (a retried call finds its first request), and every call that returns a future
becomes a request row that the model's worker applies (worker/tinker_model.py).

Ids follow Tinker's: a model is ``{session}:train:{n}`` (the SDK derives it itself when it
restores from a saved state), a sampler ``{session}:sample:{n}``. Sampling sessions and their
calls: app.tinker.samplers.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core import db as db_boundary
from app.core import projects_repository
from app.core.clock import utcnow
from app.core.errors import ApiError, Gone, NotFound, TooManyRequests
from app.core.settings import Settings
from app.core.tinker_tables import TinkerModel, TinkerRequest, TinkerSession
from app.tinker import names, storage
from app.tinker import repository as repo
from app.tinker.dispatch import send_model
from app.tinker.states import ENDED_MODEL_STATUSES, ModelStatus, RequestKind, RequestStatus
from app.tinker.status_repository import requeue_model
from jobspec.job import PACKAGED_MODELS

# The LoRA ranks a training client may ask for.
MAX_LORA_RANK = 256
# Retry-After of a full quota: a session or model frees up when a client stops heartbeating.
QUOTA_RETRY_S = 30
QUEUE_RETRY_S = 2


class TinkerBadRequest(ApiError):
    """A call the SDK must not retry: 400 with a body (the SDK retries an empty 400)."""

    status_code = 400


@dataclass(frozen=True)
class Accepted:
    """A call that returns a future: what its first answer carries."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def trainable_models(settings: Settings) -> tuple[str, ...]:
    """The base models this deployment trains through the Tinker API: the packaged ones, and
    their aliases (GRPO_TINKER_MODEL_ALIASES)."""
    return (*PACKAGED_MODELS, *settings.tinker_alias_map)


# ------------------------------------------------------------------ sessions


def create_session(
    db: Session,
    settings: Settings,
    project_id: str,
    *,
    display_name: str | None,
    tags: list[str],
    user_metadata: dict[str, Any],
    sdk_version: str | None,
) -> str:
    # Counted and inserted under the project's lock: a burst cannot pass the quota.
    projects_repository.lock(db, project_id=project_id)
    since = repo.stale_since(utcnow(), settings.tinker_session_ttl_s)
    if repo.live_sessions(db, project_id=project_id, since=since) >= (
        settings.tinker_max_sessions_per_project
    ):
        raise TooManyRequests(
            f"this project holds {settings.tinker_max_sessions_per_project} live Tinker "
            "sessions (GRPO_TINKER_MAX_SESSIONS_PER_PROJECT); close one or let it expire",
            retry_after=QUOTA_RETRY_S,
        )
    row = TinkerSession(
        id=new_id("ts"),
        project_id=project_id,
        display_name=display_name,
        tags=list(tags),
        user_metadata=dict(user_metadata),
        sdk_version=sdk_version,
        created_at=utcnow(),
        heartbeat_at=utcnow(),
    )
    db.add(row)
    db.flush()
    return row.id


def live_session(
    db: Session, settings: Settings, project_id: str, session_id: str
) -> TinkerSession:
    """The project's session, alive (404 when it is not the project's, 410 once it ended)."""
    row = repo.get_session(db, project_id=project_id, session_id=session_id)
    if row is None:
        raise NotFound(f"no Tinker session {session_id[:120]!r}", param="session_id")
    stale = repo.stale_since(utcnow(), settings.tinker_session_ttl_s)
    heartbeat = (
        row.heartbeat_at
        if row.heartbeat_at.tzinfo
        else row.heartbeat_at.replace(tzinfo=stale.tzinfo)
    )
    if row.finished_at is not None or heartbeat < stale:
        raise Gone(
            f"Tinker session {row.id} has ended (finished, or no heartbeat for "
            f"{settings.tinker_session_ttl_s:.0f} s); create a new one and restore from a "
            "saved state",
            param="session_id",
        )
    return row


def heartbeat(db: Session, settings: Settings, project_id: str, session_id: str) -> None:
    live_session(db, settings, project_id, session_id).heartbeat_at = utcnow()


def finish_session(db: Session, project_id: str, session_id: str, reason: str | None) -> None:
    row = repo.get_session(db, project_id=project_id, session_id=session_id)
    if row is None:
        raise NotFound(f"no Tinker session {session_id[:120]!r}", param="session_id")
    if row.finished_at is None:  # the first reason wins
        row.finished_at = utcnow()
        row.finish_reason = (reason or "unknown")[:32]


# ------------------------------------------------------------------ training models


def _check_model_quota(db: Session, settings: Settings, project_id: str) -> None:
    if repo.live_models(db, project_id=project_id) >= settings.tinker_max_models_per_project:
        raise TooManyRequests(
            f"this project holds {settings.tinker_max_models_per_project} Tinker training "
            "clients (GRPO_TINKER_MAX_MODELS_PER_PROJECT), each a model resident on a worker; "
            "end a session to free one",
            retry_after=QUOTA_RETRY_S,
        )


def new_model(
    db: Session,
    settings: Settings,
    project_id: str,
    *,
    session_id: str,
    model_seq_id: int,
    kind: RequestKind,
    body: bytes,
    fields: dict[str, Any],
    model_id: str | None = None,
) -> Accepted:
    """A training client's row and its first request (create_model or load_weights), sent to
    a worker once committed (``model_id``: the SDK's own form unless given). A retried creation
    finds its first request."""
    live_session(db, settings, project_id, session_id)
    model_id = model_id or names.training_model_id(session_id, model_seq_id)
    existing = repo.get_model(db, project_id=project_id, model_id=model_id)
    if existing is not None:
        first = repo.find_request(db, model_id=model_id, seq_key="0")
        if first is not None and first.kind == kind:
            return Accepted(first.request_id, model_id)
        raise TinkerBadRequest(f"model_seq_id {model_seq_id} is taken", param="model_seq_id")
    projects_repository.lock(db, project_id=project_id)  # the count and the insert as one
    _check_model_quota(db, settings, project_id)
    now = utcnow()
    model = TinkerModel(
        id=model_id,
        session_id=session_id,
        project_id=project_id,
        created_at=now,
        queued_at=now,
        dispatched_at=now,
        **fields,
    )
    db.add(model)
    db.flush()
    request = accept_request(db, settings, model, "0", kind, body)
    db_boundary.after_commit(db, lambda _: send_model(settings, model_id))
    return Accepted(request.request_id, model_id)


def check_base_model(settings: Settings, base_model: str) -> None:
    if base_model not in trainable_models(settings):
        raise TinkerBadRequest(
            f"base_model {base_model[:200]!r} is not trained here; the models this server "
            f"trains: {', '.join(trainable_models(settings))} "
            "(GET /api/v1/get_server_capabilities)",
            param="base_model",
        )


def create_model(
    db: Session,
    settings: Settings,
    project_id: str,
    *,
    session_id: str,
    model_seq_id: int,
    base_model: str,
    lora_rank: int,
    lora: dict[str, Any],
    body: bytes,
) -> Accepted:
    check_base_model(settings, base_model)
    if not 1 <= lora_rank <= MAX_LORA_RANK:
        raise TinkerBadRequest(
            f"lora_config.rank must be 1..{MAX_LORA_RANK}, got {lora_rank}", param="lora_config"
        )
    fields = {
        "base_model": base_model,
        "trained_model": settings.tinker_alias_map.get(base_model),
        "lora_rank": lora_rank,
        "lora": dict(lora),
    }
    return new_model(
        db,
        settings,
        project_id,
        session_id=session_id,
        model_seq_id=model_seq_id,
        kind="create_model",
        body=body,
        fields=fields,
    )


def load_model(
    db: Session,
    settings: Settings,
    project_id: str,
    *,
    session_id: str,
    model_seq_id: int,
    source_model_id: str,
    name: str,
    optimizer: bool,
    body: bytes,
) -> Accepted:
    """A new training client from a saved state (``load_weights`` with a session): the saved
    model's base and LoRA settings, its weights, and its optimizer state when asked."""
    saved = repo.get_checkpoint(
        db, project_id=project_id, model_id=source_model_id, kind="weights", name=name
    )
    source = repo.get_model(db, project_id=project_id, model_id=source_model_id)
    if saved is None or source is None:
        raise NotFound(f"no saved state tinker://{source_model_id}/weights/{name}", param="path")
    fields = {
        "base_model": source.base_model,
        "trained_model": source.trained_model,
        "lora_rank": source.lora_rank,
        "lora": dict(source.lora),
        "restore_from": saved.folder,
        "restore_optimizer": optimizer,
    }
    return new_model(
        db,
        settings,
        project_id,
        session_id=session_id,
        model_seq_id=model_seq_id,
        kind="load_weights",
        body=body,
        fields=fields,
    )


def usable_model(db: Session, settings: Settings, project_id: str, model_id: str) -> TinkerModel:
    """The project's model, still held (404 when not the project's; 410 once it ended)."""
    row = repo.get_model(db, project_id=project_id, model_id=model_id)
    if row is None:
        raise NotFound(f"no Tinker model {model_id[:120]!r}", param="model_id")
    if row.status in ENDED_MODEL_STATUSES:
        raise Gone(
            f"model {row.id} is no longer held: {row.error_message or row.status}"
            + (f"; restore it from {row.last_saved_path}" if row.last_saved_path else ""),
            param="model_id",
        )
    live_session(db, settings, project_id, row.session_id)
    return row


def submit(
    db: Session,
    settings: Settings,
    project_id: str,
    *,
    model_id: str,
    seq_id: int,
    kind: RequestKind,
    body: bytes,
) -> Accepted:
    """A training call (forward_backward, forward, optim_step, save_weights,
    save_weights_for_sampler): accepted once per ``seq_id``, in increasing order."""
    model = usable_model(db, settings, project_id, model_id)
    if names.is_base_sampler_model(model.id):
        raise TinkerBadRequest(
            f"model {model.id} samples its base model for a sampling session; it takes no "
            "training calls",
            param="model_id",
        )
    repeated = repo.find_request(db, model_id=model_id, seq_key=str(seq_id))
    if repeated is not None:  # the SDK re-sent a call it had no answer for
        return Accepted(repeated.request_id, model_id)
    # The project's lock before the model's row (accept_request takes it too): every writer
    # takes them in that order, so two calls never wait on each other's.
    projects_repository.lock(db, project_id=project_id)
    locked = repo.lock_model(db, project_id=project_id, model_id=model_id) or model
    if locked.status in ENDED_MODEL_STATUSES:  # ended since it was read
        usable_model(db, settings, project_id, model_id)
    if seq_id <= locked.last_seq:
        raise TinkerBadRequest(
            f"wrong seq order: seq_id {seq_id} after {locked.last_seq} (each call of a "
            "training client takes the next seq_id)",
            param="seq_id",
        )
    request = accept_request(db, settings, locked, str(seq_id), kind, body)
    # A seq_id accepted counts as used even if the worker fails the call: the SDK never sends
    # a rejected seq_id again, it moves on to the next.
    locked.last_seq = seq_id
    try:
        db.flush()
    except IntegrityError:  # a concurrent retry of the same seq_id won the insert
        db.rollback()
        raise TooManyRequests("the same call is being accepted; retry", retry_after=1) from None
    return Accepted(request.request_id, model_id)


def accept_request(
    db: Session,
    settings: Settings,
    model: TinkerModel,
    seq_key: str,
    kind: RequestKind,
    body: bytes,
) -> TinkerRequest:
    """A call of ``model`` stored for its worker, within the project's bounds (counted under
    the project's lock: calls waiting for the model, bytes stored); a released model goes back
    to the queue with it (its next worker loads it where it was)."""
    projects_repository.lock(db, project_id=model.project_id)
    # The row as it is now, locked: a worker releasing the model meanwhile either committed
    # (then it is requeued below) or fails its fenced release on the new last_request_at.
    model = repo.lock_model(db, project_id=model.project_id, model_id=model.id) or model
    model.last_request_at = utcnow()
    if repo.queued_requests(db, model_id=model.id) >= settings.tinker_max_queued_per_model:
        raise TooManyRequests(
            f"model {model.id} has {settings.tinker_max_queued_per_model} calls waiting "
            "(GRPO_TINKER_MAX_QUEUED_PER_MODEL)",
            retry_after=QUEUE_RETRY_S,
        )
    storage.check_room(db, settings, project_id=model.project_id, adding=len(body))
    row = TinkerRequest(
        request_id=new_id("tr"),
        project_id=model.project_id,
        model_id=model.id,
        seq_key=seq_key,
        kind=kind,
        body=body,
        stored_bytes=len(body),
        status=RequestStatus.QUEUED.value,
        created_at=utcnow(),
    )
    db.add(row)
    if model.status == ModelStatus.RELEASED:
        requeue_released(db, settings, model)
    db.flush()
    return row


def requeue_released(db: Session, settings: Settings, model: TinkerModel) -> None:
    """Send a released model to the queue again (its call just arrived): a worker claims it
    and loads the state it was released with (``idle_state``)."""
    requeue_model(model, now=utcnow())
    model_id = model.id
    db_boundary.after_commit(db, lambda _: send_model(settings, model_id))
