"""The rules of the Tinker API's sampling sessions: over a training client's saved weights (a
save, or a snapshot taken by save_weights_and_get_sampling_client), or over a base model alone,
and their sample calls, each a request row the worker holding the sampler's model applies."""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.core.errors import NotFound
from app.core.settings import Settings
from app.core.tinker_tables import TinkerModel, TinkerSampler
from app.tinker import names
from app.tinker import repository as repo
from app.tinker.service import (
    Accepted,
    TinkerBadRequest,
    accept_request,
    check_base_model,
    live_session,
    new_model,
    usable_model,
)


def _new_sampler(
    db: Session,
    project_id: str,
    *,
    session_id: str,
    sampling_seq_id: int,
    model_id: str,
    base_model: str,
    model_path: str | None,
) -> str:
    """The sampling session's row (``{session}:sample:{n}``); a retried creation (the same
    source) finds it, another source under a taken ``sampling_seq_id`` is a 400."""
    sampler_id = names.sampler_id(session_id, sampling_seq_id)
    existing = repo.get_sampler(db, project_id=project_id, sampler_id=sampler_id)
    if existing is not None:
        if (existing.model_id, existing.model_path, existing.base_model) == (
            model_id,
            model_path,
            base_model,
        ):
            return sampler_id  # a retried creation
        raise TinkerBadRequest(
            f"sampling_session_seq_id {sampling_seq_id} is taken", param="sampling_session_seq_id"
        )
    db.add(
        TinkerSampler(
            id=sampler_id,
            session_id=session_id,
            project_id=project_id,
            base_model=base_model,
            model_id=model_id,
            model_path=model_path,
            created_at=utcnow(),
        )
    )
    db.flush()
    return sampler_id


def add_sampler(
    db: Session,
    settings: Settings,
    project_id: str,
    *,
    session_id: str,
    sampling_seq_id: int,
    model_id: str,
    model_path: str | None,
) -> str:
    """A sampling session over a training model's saved weights: a save (``model_path``), or
    a snapshot of its current weights (None: save_weights_and_get_sampling_client)."""
    live_session(db, settings, project_id, session_id)
    model = usable_model(db, settings, project_id, model_id)
    return _new_sampler(
        db,
        project_id,
        session_id=session_id,
        sampling_seq_id=sampling_seq_id,
        model_id=model_id,
        base_model=model.base_model,
        model_path=model_path,
    )


def add_base_sampler(
    db: Session,
    settings: Settings,
    project_id: str,
    *,
    session_id: str,
    sampling_seq_id: int,
    base_model: str,
) -> str:
    """A sampling session over a base model alone (``create_sampling_client(base_model=...)``).
    Sampling runs where a model is resident, so the session gets a model of its own, which a
    worker holds as it holds a training client (it counts against the project's training
    clients): fresh adapters whose B is zero, never trained, so it samples exactly the base
    model. A retried creation finds both."""
    check_base_model(settings, base_model)
    model_id = names.base_sampler_model_id(session_id, sampling_seq_id)
    fields = {
        "base_model": base_model,
        "trained_model": settings.tinker_alias_map.get(base_model),
        "lora_rank": 1,  # the smallest resident adapters; B = 0 leaves the base untouched
        "lora": {"train_attn": True, "train_mlp": False, "train_unembed": False, "seed": 0},
    }
    new_model(
        db,
        settings,
        project_id,
        session_id=session_id,
        model_seq_id=sampling_seq_id,
        kind="create_model",
        body=b"{}",
        fields=fields,
        model_id=model_id,
    )
    return _new_sampler(
        db,
        project_id,
        session_id=session_id,
        sampling_seq_id=sampling_seq_id,
        model_id=model_id,
        base_model=base_model,
        model_path=None,
    )


def sampler_model(db: Session, settings: Settings, project_id: str, sampler_id: str) -> TinkerModel:
    """The model a sampling session samples, still held (404 when the project has no such
    session; 410 once the model ended)."""
    sampler = repo.get_sampler(db, project_id=project_id, sampler_id=sampler_id)
    if sampler is None or sampler.model_id is None:
        raise NotFound(f"no sampling session {sampler_id[:120]!r}", param="sampling_session_id")
    return usable_model(db, settings, project_id, sampler.model_id)


def submit_sample(
    db: Session,
    settings: Settings,
    *,
    sampler_id: str,
    model: TinkerModel,
    seq_id: int,
    num_samples: int,
    body: bytes,
) -> Accepted:
    """A sample call of the sampling session ``sampler_id`` on its model (``sampler_model``),
    applied by the worker holding that model; a re-sent call (same sampler and seq_id) finds
    its first request."""
    key = f"sample:{sampler_id}:{seq_id}"
    repeated = repo.find_request(db, model_id=model.id, seq_key=key)
    if repeated is None:
        repeated = accept_request(db, settings, model, key, "sample", body)
    ids = [f"{repeated.request_id}:{i}" for i in range(num_samples)]
    return Accepted(repeated.request_id, model.id, sample_sequence_ids=ids)
