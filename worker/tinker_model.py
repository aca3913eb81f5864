"""Hold a Tinker training model resident and apply its calls (the task ``worker.tinker_model``).

A Tinker training client (app/tinker) is a LoRA model that lives on one worker for as long as
its session does. The API stores each call as a request row; this worker:

1. claims the model: one fenced update of its ``tinker_models`` row (``starting``, no live
   lease); a model another worker holds is left alone ("not claimed");
2. loads it: the base model, confined as a job's model is (worker.runner.confined_model), with
   fresh LoRA adapters, or the saved state of a ``load_weights`` creation; a failure fails the
   model and its calls (an unknown or refused base model is the user's error);
3. applies its queued calls one at a time in arrival order (worker.tinker_requests), writing
   each result or error into its row, until the session ends (finished, or silent past
   ``tinker_session_ttl_s``: closed), the worker shuts down (failed, naming the last saved
   state: the weights in memory are gone with the process) or the lease is lost (the API
   ended the model: nothing more is written).

A worker holds a whole session: while it serves a model, it also takes the session's and the
project's other models that no worker holds yet (a second training client, one restored from a
saved state), each served by a thread of its own in this process until its session ends; and
another project's model that no idle worker took within a few seconds (up to
``GRPO_TINKER_MODELS_PER_WORKER`` models in all). A solo-pool worker (one task at a time) could
otherwise never load a second model while it holds the first, and the client would wait on it
until the first session ends.

Sharing with jobs and other tenants: training clients come on a queue of their own
(GRPO_TINKER_QUEUE); a worker that serves jobs too takes a waiting job first (its queues are
read in order: app.core.queue, app.core.broker_order); a project's clients are
held by at most ``GRPO_TINKER_MAX_WORKERS_PER_PROJECT`` workers; and a model without a call
for ``GRPO_TINKER_IDLE_RELEASE_S`` is written to disk and its worker freed
(worker.tinker_idle), to be loaded again, where it was, on its next call.

The lease on the row is renewed by a thread (worker.tinker_lease).
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.core.db import session_scope
from app.core.tinker_tables import TinkerModel
from app.tinker import repository as repo
from app.tinker import worker_repository as q
from app.tinker.states import ModelStatus
from app.tinker.worker_repository import ModelRef
from jobspec import PACKAGED_MODELS
from trainer.errors import TrainerError
from worker.context import WorkerContext
from worker.retry import with_db_retry
from worker.runner import confined_model
from worker.settings import WorkerSettings
from worker.tinker_idle import release_idle, remove_idle_state
from worker.tinker_lease import ModelLease
from worker.tinker_saves import checkpoint_root

if TYPE_CHECKING:
    from trainer.primitives import ResidentModel, WeightsSnapshot
    from worker.tinker_requests import HeldModel

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long an idle model waits between two looks at its queue: a call's latency floor.
IDLE_POLL_S = 0.05
# How often an idle model looks for models that no worker holds yet, and how long another
# session's model waits for an idle worker before a busy one takes it.
ADOPT_EVERY_S = 1.0
ADOPT_OTHERS_AFTER_S = 5.0


def hold_tinker_model(ctx: WorkerContext, model_id: str) -> str:
    """Claim, load and serve `model_id` (and the session's other waiting models) until its
    session ends; returns a short outcome word (for logs and tests): not_claimed, failed,
    closed, worker_stopped or lease_lost."""
    ref = _claim(ctx, model_id)
    if ref is None:
        log.info("tinker model %s is not claimable (held elsewhere, or over)", model_id)
        return "not_claimed"
    adopted: list[threading.Thread] = []
    try:
        return _hold(ctx, ref, adopted)
    finally:
        for thread in adopted:  # each ends with the session, or as this worker stops
            thread.join()


def _adopt_waiting(ctx: WorkerContext, ref: ModelRef, adopted: list[threading.Thread]) -> None:
    """Claim models no worker holds yet, up to ``tinker_models_per_worker`` held in all, and
    serve each in a thread: the session's own at once, another session's once no idle worker
    took it within ``ADOPT_OTHERS_AFTER_S`` (a single worker, the embedded default, then
    serves every session instead of leaving the next client waiting for this session's end)."""
    room = ctx.settings.tinker_models_per_worker - 1 - sum(t.is_alive() for t in adopted)
    if room <= 0:
        return
    now = utcnow()
    stale = repo.stale_since(now, ctx.settings.lease_seconds)
    unclaimed = repo.stale_since(now, ADOPT_OTHERS_AFTER_S)
    waiting = _db(
        ctx,
        ref,
        lambda db: q.waiting_models(
            db,
            session_id=ref.session_id,
            project_id=ref.project_id,
            stale_before=stale,
            unclaimed_before=unclaimed,
            limit=room,
        ),
    )
    for model_id in waiting:
        other = _claim(ctx, model_id)
        if other is None:
            continue
        thread = threading.Thread(
            target=_hold, args=(ctx, other, adopted), name=f"tinker-{model_id}", daemon=True
        )
        adopted.append(thread)
        thread.start()


def _hold(ctx: WorkerContext, ref: ModelRef, adopted: list[threading.Thread]) -> str:
    """Load and serve a claimed model until its session ends."""
    settings = ctx.settings
    with ModelLease(ctx.sessions, ref, settings) as lease:
        lease.beat()  # a session that ended while the model was queued loads nothing
        if lease.lost.is_set():
            return "lease_lost"
        if lease.session_over.is_set():
            return _closed(ctx, ref, lease)
        try:
            held = _load(ctx, ref)
        except Exception as exc:
            category, message = _load_failure(ref, exc)
            _end(ctx, ref, ModelStatus.FAILED, message, category=category)
            return "failed"
        ctx.held_tinker_models.add(ref.id)
        try:
            with session_scope(ctx.sessions) as db:
                ready = q.mark_ready(
                    db, model_id=ref.id, owner=ref.owner, model_folder=str(held.folder)
                )
            if not ready:
                return "lease_lost"
            return _serve(ctx, ref, held, lease, adopted)
        finally:
            ctx.held_tinker_models.discard(ref.id)
            held.close()


def _claim(ctx: WorkerContext, model_id: str) -> ModelRef | None:
    now = utcnow()
    settings = ctx.settings
    owner = settings.worker_name
    with session_scope(ctx.sessions) as db:
        stale = repo.stale_since(now, settings.lease_seconds)
        row = db.get(TinkerModel, model_id)
        if row is None or not q.project_may_use(
            db,
            project_id=row.project_id,
            owner=owner,
            stale_before=stale,
            max_workers=settings.tinker_max_workers_per_project,
        ):
            return None  # the project's workers take it (or the sweep sends it again)
        if not q.claim(db, model_id=model_id, owner=owner, now=now, stale_before=stale):
            return None
        db.refresh(row)
        return ModelRef(row.id, row.session_id, row.project_id, row.base_model, owner)


def model_folder(base_model: str, settings: WorkerSettings) -> Path:
    """The local folder of a base model: confined as a job's model is (packaged models, folders
    under the operator's model roots, Hub models under the operator's Hub rules), a packaged
    one built on first use."""
    name = confined_model(base_model, None, settings)
    if name in PACKAGED_MODELS:
        from trainer.models.loading import resolve_model  # torch: only once a model loads

        return resolve_model(name)
    return Path(name)


def _load(ctx: WorkerContext, ref: ModelRef) -> HeldModel:
    """The resident model of the claimed row: a fresh LoRA, or a saved state to continue."""
    from trainer.primitives import ResidentModel  # torch: only once a model loads
    from worker.tinker_requests import HeldModel

    settings = ctx.settings
    with session_scope(ctx.sessions) as db:
        row = db.get(TinkerModel, ref.id)
        assert row is not None
        lora, rank = dict(row.lora or {}), row.lora_rank
        restore_from, restore_optimizer = row.restore_from, row.restore_optimizer
        last_saved, idle_state = row.last_saved_path, row.idle_state
        trained = row.model_trained  # an alias's packaged model (GRPO_TINKER_MODEL_ALIASES)
    folder = model_folder(trained, settings)
    resident: ResidentModel
    snapshots: dict[str, WeightsSnapshot] = {}
    if idle_state is not None:  # released when idle: it continues where it was
        _check_own(settings, ref, Path(idle_state))
        resident, snapshots = ResidentModel.resume(
            Path(idle_state),
            folder,
            device=settings.device,
            max_tokens_per_call=settings.tinker_max_tokens_per_call,
        )
    elif restore_from is not None:
        saved = Path(restore_from)
        _check_own(settings, ref, saved)
        resident = ResidentModel.load_state(
            saved,
            folder,
            optimizer=restore_optimizer,
            device=settings.device,
            max_tokens_per_call=settings.tinker_max_tokens_per_call,
        )
    else:
        resident = ResidentModel(
            folder,
            lora_rank=rank,
            train_attn=bool(lora.get("train_attn", True)),
            train_mlp=bool(lora.get("train_mlp", True)),
            train_unembed=bool(lora.get("train_unembed", True)),
            seed=lora.get("seed"),
            device=settings.device,
            max_tokens_per_call=settings.tinker_max_tokens_per_call,
            base_model=ref.base_model,
        )
    held = HeldModel(ctx.sessions, settings, ref, resident, folder)
    held.last_saved_path = last_saved
    held.restore_snapshots(snapshots)
    return held


def _check_own(settings: WorkerSettings, ref: ModelRef, saved: Path) -> None:
    """The API and this worker name folders of the project's own; refuse anything else all
    the same."""
    if not saved.resolve().is_relative_to(checkpoint_root(settings, ref.project_id)):
        raise TrainerError(f"the saved state of model {ref.id} is not one of its project's")


def _load_failure(ref: ModelRef, exc: Exception) -> tuple[str, str]:
    """The category and message of a model that could not be loaded. A TrainerError (a base
    model refused, not cached or unknown) is the user's, with our own message; anything else
    is logged under a reference, since its message may name server paths."""
    from worker.tinker_requests import USER_ERRORS  # torch: the primitives' error type

    if isinstance(exc, (TrainerError, *USER_ERRORS)):
        return "user", f"model {ref.id} could not be loaded: {str(exc)[:2000]}"
    reference = secrets.token_hex(6)
    log.error("tinker model %s: load failed (reference %s)", ref.id, reference, exc_info=exc)
    return "server", (
        f"model {ref.id} could not be loaded: internal error ({type(exc).__name__}, reference "
        f"{reference}); the operator's worker log has the details"
    )


def _serve(
    ctx: WorkerContext,
    ref: ModelRef,
    held: HeldModel,
    lease: ModelLease,
    adopted: list[threading.Thread],
) -> str:
    """Apply the model's calls in order until the session ends, the worker stops or the lease
    is lost; when idle, take the session's waiting models too."""
    adopt_at = 0.0
    idle_since = time.monotonic()
    while True:
        if lease.lost.is_set():
            return "lease_lost"
        if ctx.shutdown.is_set():
            saved = held.last_saved_path
            message = f"the worker holding model {ref.id} stopped" + (
                f"; restore it from {saved}" if saved else " before any save_state"
            )
            _end(ctx, ref, ModelStatus.FAILED, message)
            return "worker_stopped"
        if lease.session_over.is_set():
            return _closed(ctx, ref, lease)
        request = _db(ctx, ref, lambda db: q.next_request(db, model_id=ref.id))
        if request is None:
            if time.monotonic() - idle_since >= ctx.settings.tinker_idle_release_s:
                if _release(ctx, ref, held):
                    return "released"
                idle_since = time.monotonic()  # a call came meanwhile: serve it
                continue
            if time.monotonic() >= adopt_at:
                _adopt_waiting(ctx, ref, adopted)
                adopt_at = time.monotonic() + ADOPT_EVERY_S
            ctx.shutdown.wait(IDLE_POLL_S)
            continue
        outcome = held.apply(request)
        idle_since = time.monotonic()
        written = _db(
            ctx,
            ref,
            functools.partial(
                q.settle,
                model_id=ref.id,
                owner=ref.owner,
                position=request.position,
                now=utcnow(),
                result=outcome.result,
                result_format=outcome.result_format,
                error=outcome.error,
                category=outcome.category,
            ),
        )
        if not written:
            lease.beat()  # not ours any more? then stop now, not at the next beat
            if not lease.lost.is_set():
                log.warning("tinker request %s was ended elsewhere", request.request_id)


def _release(ctx: WorkerContext, ref: ModelRef, held: HeldModel) -> bool:
    """Write the idle model to disk and give up this worker (worker.tinker_idle); False when
    it stays (a call arrived, or the write failed: logged, tried again after another idle
    period)."""
    previous = _db(ctx, ref, lambda db: q.idle_state_of(db, model_id=ref.id))
    try:
        return release_idle(ctx, held, previous)
    except Exception:  # a full disk must not end the model: it stays resident
        log.exception("tinker model %s: idle release failed; it stays resident", ref.id)
        return False


def _db(ctx: WorkerContext, ref: ModelRef, work: Callable[[Session], T]) -> T:
    """``work`` in a unit of work of its own, retried through a short database outage: the
    model's weights live only in this process, so a Postgres restart must not end it."""

    def unit() -> T:
        with session_scope(ctx.sessions) as db:
            return work(db)

    return with_db_retry(
        unit, budget_s=ctx.settings.db_retry_seconds, what=f"tinker model {ref.id}"
    )


def _closed(ctx: WorkerContext, ref: ModelRef, lease: ModelLease) -> str:
    # The client ended the session (or stopped heartbeating): its calls left are its own doing.
    message = f"session ended ({lease.end_reason}); model {ref.id} was closed"
    return _end(ctx, ref, ModelStatus.CLOSED, message, category="user")


def _end(
    ctx: WorkerContext,
    ref: ModelRef,
    status: ModelStatus,
    message: str,
    *,
    category: str = "server",
) -> str:
    """End the model (closed or failed) and fail its queued calls; the outcome word."""
    ended = _db(
        ctx,
        ref,
        lambda db: q.end_model(
            db,
            model_id=ref.id,
            owner=ref.owner,
            status=status,
            message=message,
            category=category,
            now=utcnow(),
        ),
    )
    if not ended:
        return "lease_lost"
    remove_idle_state(_db(ctx, ref, lambda db: q.idle_state_of(db, model_id=ref.id)))
    log.info("tinker model %s: %s (%s)", ref.id, status, message)
    return status.value
