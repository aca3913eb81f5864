"""The saves of a held Tinker model (worker/tinker_requests.py): where they live, how one is
written and recorded, and how a ``tinker://`` path is found again.

A save goes under ``<checkpoint dir>/tinker/<project>/<model>/<kind>/<name>``
(jobspec.checkpoint_files.tinker_save_folder, where the inference tier finds sampler weights;
``weights``: the state with the optimizer; ``sampler_weights``: the adapter) and is recorded in
``tinker_checkpoints``; a path is only ever resolved through that table, within the model's
own project, never by joining what the client wrote onto a folder.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.core.clock import utcnow
from app.core.db import session_scope
from app.tinker import names
from app.tinker import repository as repo
from app.tinker import worker_repository as q
from app.tinker.worker_repository import ModelRef
from app.usage import service as storage
from jobspec.checkpoint_files import (
    TINKER_DIR,
    folder_bytes,
    remove_folder,
    tinker_project_folder,
    tinker_save_folder,
)
from worker.settings import WorkerSettings


class RequestRefused(ValueError):
    """A call the worker refuses for what it asks (the user's error)."""


def checkpoint_root(settings: WorkerSettings, project_id: str) -> Path:
    """Where a project's Tinker saves live (each model's in a folder of its own)."""
    return tinker_project_folder(settings.resolved_checkpoint_dir, project_id)


def write_save(
    sessions: sessionmaker[Session],
    settings: WorkerSettings,
    ref: ModelRef,
    kind: str,
    name: str,
    write: Callable[[Path], None],
    *,
    overwrite: bool,
    ttl_seconds: int | None,
    user_metadata: dict[str, Any] | None,
) -> str:
    """Write a save of the model with ``write(folder)`` (a ResidentModel's save_state or
    save_adapter) and record it; its tinker path. RequestRefused for a name in use without
    ``overwrite``."""
    path = names.tinker_path(ref.id, kind, name)  # refuses a name that is not one
    with session_scope(sessions) as db:
        taken = (
            repo.live_checkpoint(
                db, project_id=ref.project_id, model_id=ref.id, kind=kind, name=name, now=utcnow()
            )
            is not None
        )
    if taken and not overwrite:
        raise RequestRefused(f"{path} exists; save under another name, or overwrite it")
    final = tinker_save_folder(settings.resolved_checkpoint_dir, ref.project_id, ref.id, kind, name)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(4)
    # The primitives write a folder whole or not at all, and never over one: a save is written
    # beside its name and swapped in, so the old one stays whole until the new one is.
    staging, replaced = parent / f".{name}.new-{token}", parent / f".{name}.old-{token}"
    try:
        write(staging)
        size = folder_bytes(staging)
        _check_room(sessions, settings, ref, kind, name, adding=size)
        if final.exists():
            final.rename(replaced)
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(replaced, ignore_errors=True)
    now = utcnow()
    with session_scope(sessions) as db:
        q.record_checkpoint(
            db,
            model_id=ref.id,
            project_id=ref.project_id,
            kind=kind,
            name=name,
            folder=str(final),
            size_bytes=size,
            user_metadata=user_metadata,
            now=now,
            expires_at=now + timedelta(seconds=ttl_seconds) if ttl_seconds else None,
        )
        if kind == "weights":
            q.set_last_saved(db, model_id=ref.id, owner=ref.owner, path=path)
    return path


def _check_room(
    sessions: sessionmaker[Session],
    settings: WorkerSettings,
    ref: ModelRef,
    kind: str,
    name: str,
    *,
    adding: int,
) -> None:
    """RequestRefused when the save would take the project's storage (its jobs' checkpoints
    and its Tinker saves) past GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT; the save it replaces, if
    any, is freed. Checked before the save is put in place, so a refused one leaves nothing."""
    limit = settings.max_checkpoint_bytes_per_project
    with session_scope(sessions) as db:
        replaced = repo.get_checkpoint(
            db, project_id=ref.project_id, model_id=ref.id, kind=kind, name=name
        )
        over = storage.room_for(
            db,
            project_id=ref.project_id,
            limit=limit,
            adding=adding,
            freeing=replaced.size_bytes if replaced is not None else 0,
        )
    if over is not None:
        assert over.limit_bytes is not None
        raise RequestRefused(
            f"save not kept: with its {storage.human_bytes(adding)} the project's checkpoints "
            f"and Tinker saves would take {storage.human_bytes(over.used_bytes)}, over its "
            f"limit of {storage.human_bytes(over.limit_bytes)} ({storage.SETTING}); delete "
            "saves you no longer need (RestClient.delete_checkpoint, or a ttl_seconds on "
            "save) or jobs' checkpoints"
        )


def remove_expired_saves(sessions: sessionmaker[Session], store: Path, *, limit: int = 500) -> int:
    """Remove the folders and rows of saves past their expiry (a TTL, or a delete); how many.
    Each row is deleted first, only if still expired (a save written again under the name
    has a new expiry), and its folder removed only then, and only inside the store's Tinker
    folder. (A save being written again under an expired name at that very moment, between
    putting its folder in place and recording it, loses its folder: it then fails to load,
    saying so.)"""
    now = utcnow()
    root = (Path(store) / TINKER_DIR).resolve()
    with session_scope(sessions) as db:
        due = q.expired_saves(db, now=now, limit=limit)
        expired = [(r.model_id, r.kind, r.name, r.folder) for r in due]
    removed = 0
    for model_id, kind, name, folder in expired:
        with session_scope(sessions) as db:
            if not q.forget_save(db, model_id=model_id, kind=kind, name=name, expired_by=now):
                continue
        if Path(folder).resolve().is_relative_to(root):
            remove_folder(Path(folder))
        removed += 1
    return removed


def saved_folder(sessions: sessionmaker[Session], ref: ModelRef, path: str, kind: str) -> Path:
    """The folder of the save at ``path``: one of this project's, of ``kind``, not expired,
    and made from this model's base model. RequestRefused (or WireError) otherwise."""
    model_id, path_kind, name = names.parse_tinker_path(path)
    if path_kind != kind:
        raise RequestRefused(f"{path} is not a {kind} save")
    with session_scope(sessions) as db:
        row = repo.live_checkpoint(
            db, project_id=ref.project_id, model_id=model_id, kind=kind, name=name, now=utcnow()
        )
        base = q.base_model_of(db, project_id=ref.project_id, model_id=model_id)
    if row is None or not Path(row.folder).is_dir():
        raise RequestRefused(f"no save {path}")
    if base != ref.base_model:
        raise RequestRefused(f"{path} was saved from {base}, not {ref.base_model}")
    return Path(row.folder)
