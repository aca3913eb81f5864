"""Idle release of a Tinker training client: a model that had no call for
``GRPO_TINKER_IDLE_RELEASE_S`` is written to disk whole (weights, Adam state, the gradients
accumulated since its last step, the sampler weights it keeps in memory:
``ResidentModel.suspend``) and gives up its worker, even while its session heartbeats. An
SDK client heartbeats by itself every 10 s, so without this one idle client kept a worker
from every job and every other client for as long as its process lived.

Its row goes ``ready -> released`` with ``idle_state`` naming the folder; the next call
sends it to the queue again (app.tinker.service.requeue_released) and the worker that claims
it loads that folder (worker.tinker_model._load): the client sees its call wait for the load,
then the same results as if the model had stayed resident. Each release writes a new folder
(``jobspec.checkpoint_files.tinker_idle_folder``) and removes the one before once the row
names the new one, so a crash between the two leaves the row's folder complete.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from app.core.db import session_scope
from app.tinker import worker_repository as q
from jobspec.checkpoint_files import remove_folder, tinker_idle_folder
from worker.context import WorkerContext

if TYPE_CHECKING:
    from worker.tinker_requests import HeldModel

log = logging.getLogger(__name__)


def idle_folder(ctx: WorkerContext, held: HeldModel) -> Path:
    """A new folder for this release of ``held`` (none exists there yet)."""
    ref = held.ref
    store = ctx.settings.resolved_checkpoint_dir
    return tinker_idle_folder(store, ref.project_id, ref.id, secrets.token_hex(8))


def release_idle(ctx: WorkerContext, held: HeldModel, previous: str | None) -> bool:
    """Write ``held`` to a new idle folder and release its row; True once released (the
    caller then drops the model). False, with nothing released, when a call arrived meanwhile
    or the lease is gone: the new folder is removed and the model keeps serving (or stops, as
    its lease says)."""
    ref = held.ref
    with session_scope(ctx.sessions) as db:
        last_call = q.last_call_at(db, model_id=ref.id)
    folder = idle_folder(ctx, held)
    folder.parent.mkdir(parents=True, exist_ok=True)
    held.suspend(folder)
    with session_scope(ctx.sessions) as db:
        released = q.release(
            db, model_id=ref.id, owner=ref.owner, idle_state=str(folder), last_call=last_call
        )
    if not released:
        remove_folder(folder)
        return False
    if previous:
        remove_idle_state(previous)
    log.info("tinker model %s: idle, released (state in %s)", ref.id, folder)
    return True


def remove_idle_state(path: str | None) -> None:
    """Remove an idle folder that no row needs any more (a model loaded again and released
    anew, or ended). Only a folder under an ``idle/`` part is touched."""
    if path and Path(path).parent.name == "idle":
        remove_folder(Path(path))
