"""Run one job attempt: claim the lease, train with database callbacks, end the job.

Outcomes, each a fenced state change:
- trained every step            -> succeeded
- cancel requested              -> cancelled (after the trainer saved a checkpoint)
- pause requested               -> paused (after the trainer saved a checkpoint; the attempt
                                   is not counted); a resume queues it and the next claim
                                   continues from that checkpoint
- SIGTERM to the worker         -> back to queued, re-sent, resumed by the next worker
- trainer error                 -> failed with the trainer's reason code (any other error:
                                   failed as `trainer_error`, details only in the worker log)
- a rank died, or a collective   -> back to queued, the attempt counted, resumed from the last
  of the ranks timed out (worker.  checkpoint; failed with the reason once max_attempts are
  stop_reasons.RETRYABLE_REASONS)  used (worker.attempts.retry)
- model outside the model roots -> failed as `model_not_allowed`, before any model is read
  (likewise a Hub repo id the operator does not allow)
- Hub model not in the cache    -> failed as `model_not_cached`, naming the model and how the
                                   operator pre-fetches it (offline workers never download)
- lease lost (another attempt)  -> nothing: the new lease holder owns the job

Whatever the outcome, the job's tracker exports (`integrations`, worker.job_exports) are ended
before it: the run's final checkpoint and status are sent within `tracker_flush_seconds`, and
what was not exported becomes an `export_failed` event. A tracker never changes the outcome.

A trainer that does not stop within `stop_grace_seconds` of a cancel, pause or SIGTERM is ended by the
heartbeat process instead (`worker.heartbeat`), which then kills this process.

The trainer is a parameter (`Train`): the worker passes nothing and gets `trainer.run.loop.train`,
imported only when a job really runs (it pulls in torch), or for a job on several devices
(`resources.devices`) the launcher of its ranks (`trainer.run.launch`); a job with http tools or
an http environment also gets the worker's clients of the operator's endpoints
(`worker.agents`, `http_tools=`/`http_environment=`); tests pass plain
functions.
"""

from __future__ import annotations

import functools
import logging
import secrets
from pathlib import Path
from typing import Any, Protocol

from app.core.db import session_scope
from app.core.models import Job
from app.datasets import repository as files_repo
from app.jobs import checkpoints_repository as checkpoints_repo
from app.jobs import repository as jobs_repo
from app.jobs import transitions
from app.jobs.transitions import JobStatus
from app.progress import repository as progress_repo
from jobspec import PACKAGED_MODELS, JobSpec, PromptRow, is_hub_repo_id
from jobspec.checkpoint_files import job_folder
from jobspec.paths import allowed_dataset_folder, dataset_refusal
from trainer.data.saved_datasets import hub_dataset_folder, saved_dataset_rows
from trainer.errors import ModelNotAllowed, TrainerError
from trainer.run.callbacks import Callbacks
from worker.attempts import end_attempt, pause, release, retry
from worker.context import WorkerContext
from worker.job_exports import close_exports, export_outcome, start_job_exports
from worker.lease import LeaseKeeper
from worker.progress import DatabaseCallbacks, LeaseLost
from worker.retry import with_db_retry
from worker.settings import WorkerSettings
from worker.stop_reasons import retryable

log = logging.getLogger(__name__)


class TrainOutcome(Protocol):
    """What the runner reads from a finished run (trainer.run.loop.TrainResult has more)."""

    @property
    def final_step(self) -> int: ...

    @property
    def stopped_early(self) -> bool: ...

    @property
    def pause_reason(self) -> str | None:
        """Set when the run paused itself (the async mismatch guard): why."""
        ...


class Train(Protocol):
    """A training run, as the runner calls it. `trainer.run.loop.train` is one; it may take more
    optional keyword arguments. Raises TrainerError (with a `reason`) for a failure of the run."""

    def __call__(
        self,
        spec: JobSpec,
        callbacks: Callbacks,
        /,
        *,
        output_dir: Path,
        resume_from: Path | None,
        device: str,
        sample_groups: int,
    ) -> TrainOutcome: ...


def load_trainer(devices: int = 1) -> Train:
    """The real trainer of a job on `devices` devices: `train` in this process for one, else
    its ranks under torchrun; torch is imported only once a job really runs."""
    if devices > 1:
        # torchrun's agent starts one rank per device; rank 0 relays the callbacks to this
        # process, where they run as for `train`. The lease stays here, and the agent and the
        # ranks die with this process.
        from trainer.run.launch import launch_ranks

        return functools.partial(launch_ranks, nproc=devices)
    from trainer.run.loop import train

    return train


def agent_endpoints(spec: JobSpec) -> dict[str, Any]:
    """``train()``'s ``http_tools``/``http_environment`` for a job on one device that names the
    operator's tool endpoints (worker.agents, imported only then); none otherwise (a job of
    several devices is refused by the trainer with the reason)."""
    if not spec.agent_endpoints or spec.resources.devices > 1:
        return {}
    from worker.agents import http_agents  # the trainer's agent types: torch

    return dict(http_agents(spec))


def load_spec(ctx: WorkerContext, job: Job) -> JobSpec:
    """The stored spec, with an uploaded file or a saved dataset resolved into inline rows, and
    a validation file's rows appended as the held-out set."""
    spec = _with_training_rows(ctx, JobSpec.model_validate(job.spec))
    validation_id = spec.dataset.validation_file_id
    if validation_id is None:
        return spec
    dataset = spec.dataset
    if dataset.rows is None:  # a generator: its rows, inline
        dataset = dataset.with_rows(dataset.all_rows())
    rows = _file_rows(ctx, validation_id)
    return spec.model_copy(update={"dataset": dataset.with_validation_rows(rows)})


def _file_rows(ctx: WorkerContext, file_id: str) -> list[PromptRow]:
    with session_scope(ctx.sessions) as session:
        file = files_repo.get(session, file_id=file_id)
        if file is None:
            raise TrainerError(f"dataset file {file_id} no longer exists", reason="file_missing")
        return [PromptRow.model_validate(r) for r in file.rows]


def _with_training_rows(ctx: WorkerContext, spec: JobSpec) -> JobSpec:
    saved = spec.dataset.saved_dataset
    if saved is not None and saved.hub_id is not None:
        if not ctx.settings.allow_hub_datasets:
            raise TrainerError(
                "this worker reads no Hub datasets (GRPO_ALLOW_HUB_DATASETS)",
                reason="dataset_not_allowed",
            )
        rows = saved_dataset_rows(saved, hub_dataset_folder(saved.hub_id, saved.revision))
        return spec.model_copy(update={"dataset": spec.dataset.with_rows(rows)})
    if saved is not None and saved.path is not None:
        settings = ctx.settings
        forbidden = [settings.data_dir, settings.resolved_checkpoint_dir]
        folder = allowed_dataset_folder(saved.path, settings.dataset_root_list, forbidden)
        if folder is None:  # the API checked it; the worker's roots decide on the worker
            raise TrainerError(
                f"dataset.saved_dataset.path {dataset_refusal(has_roots=bool(settings.dataset_root_list))}",
                reason="dataset_not_allowed",
            )
        rows = saved_dataset_rows(saved, folder)
        return spec.model_copy(update={"dataset": spec.dataset.with_rows(rows)})
    file_id = spec.dataset.file_id
    if file_id is None:
        return spec
    rows = _file_rows(ctx, file_id)
    return spec.model_copy(update={"dataset": spec.dataset.with_rows(rows)})


def latest_checkpoint(ctx: WorkerContext, job_id: str) -> Path | None:
    """The newest checkpoint recorded for the job (and not deleted by its retention) whose
    folder still exists."""
    with session_scope(ctx.sessions) as session:
        rows = progress_repo.checkpoints(session, job_id=job_id, newest_first=True)
    for row in rows:
        path = Path(row.path)
        if path.is_dir():
            return path
    return None


def _end(
    ctx: WorkerContext,
    job_id: str,
    attempt: int,
    target: JobStatus,
    *,
    message: str,
    error_code: str | None = None,
) -> None:
    end_attempt(ctx.sessions, job_id, attempt, target, message=message, error_code=error_code)
    ctx.tail.notify(job_id, "status")


def confine_model(spec: JobSpec, settings: WorkerSettings) -> JobSpec:
    """The spec with `model` checked against the operator's model roots or Hub rules (again:
    the API checked at submission), and a folder or Hub repo id replaced by the real folder, so
    the trainer opens exactly the folder that was checked (see confined_model)."""
    if spec.model in PACKAGED_MODELS:  # the trainer builds it from its name
        return spec
    model = confined_model(spec.model, spec.model_revision, settings)
    return spec.model_copy(update={"model": model, "model_revision": None})


def confined_model(model: str, revision: str | None, settings: WorkerSettings) -> str:
    """What a worker may load for the model name `model` (a job's, or a Tinker training
    client's base model, worker.tinker_model): a packaged model's name unchanged, else the real
    folder of a folder under the operator's model roots or of a Hub model's snapshot in the
    worker's Hugging Face cache. Raises ModelNotAllowed, ModelNotCached or ModelNotFound
    (TrainerErrors, whose messages the user sees) otherwise."""
    if model in PACKAGED_MODELS:
        return model
    if is_hub_repo_id(model):
        refusal = settings.hub_model_refusal(model)
        if refusal is not None:
            raise ModelNotAllowed(refusal)
    from trainer.models.loading import resolve_model  # torch: only for a model that is a folder

    folder = resolve_model(
        model,
        revision=revision,
        allowed_roots=[Path(root) for root in settings.model_root_list],
        forbidden=[settings.data_dir, settings.resolved_checkpoint_dir],
    )
    return str(folder)


def starting_model(ctx: WorkerContext, job: Job, spec: JobSpec) -> JobSpec:
    """The spec with `model` set to the folder the run starts from: the checkpoint `init_from`
    names (looked up by job and step within the job's own project, never by a path the user
    wrote), or the confined `model` folder (see confine_model)."""
    init = spec.init_from
    if init is None:
        return confine_model(spec, ctx.settings)
    with session_scope(ctx.sessions) as session:
        row = checkpoints_repo.checkpoint_of_project_job(
            session, project_id=job.project_id, job_id=init.job_id, step=init.step
        )
        folder = Path(row.path) if row is not None else None
    if folder is None or not (folder / "config.json").is_file():
        # Admission checked it at submission; the checkpoint was deleted since.
        raise TrainerError(
            f"init_from: job {init.job_id} has no checkpoint at step {init.step} any more",
            reason="init_checkpoint_missing",
        )
    return spec.model_copy(update={"model": str(folder)})


def _claim(ctx: WorkerContext, job_id: str) -> tuple[int, Job] | None:
    """Take the lease; the claimed job as it is now, or None when it is not claimable."""
    with session_scope(ctx.sessions) as session:
        attempt = transitions.claim(session, job_id, ctx.settings.worker_name)
        if attempt is None:
            return None
        job = jobs_repo.get(session, job_id=job_id)
        if job is None:
            return None
        return attempt, jobs_repo.reload(session, job=job)


def run_job(ctx: WorkerContext, job_id: str, *, train: Train | None = None) -> str:
    """Run one attempt of `job_id` with `train` (default: the real trainer); returns a short
    outcome word (for logs and tests)."""
    settings = ctx.settings
    claimed = _claim(ctx, job_id)
    if claimed is None:
        log.info("job %s is not claimable (lease held, finished or cancelled)", job_id)
        return "not_claimed"
    attempt, job = claimed

    lease = LeaseKeeper(
        ctx.sessions, job_id, attempt, settings.heartbeat_seconds, settings=settings
    )
    exports = start_job_exports(settings, job_id, job)
    callbacks = DatabaseCallbacks(ctx, job_id, attempt, lease, exports)
    result: TrainOutcome | None = None
    error: Exception | None = None
    with lease:
        try:
            # These reads retry through a database outage like every write of the run: a
            # Postgres restart right after the claim failed the job (found by bench/chaos.py).
            spec, resume_from = with_db_retry(
                lambda: (
                    starting_model(ctx, job, load_spec(ctx, job)),
                    latest_checkpoint(ctx, job_id),
                ),
                budget_s=settings.db_retry_seconds,
                what=f"job {job_id}: reading its spec and checkpoints",
            )
            callbacks.retention = spec.checkpoint  # the worker applies it, not the trainer
            run = train or load_trainer(spec.resources.devices)
            result = run(
                spec,
                callbacks,
                output_dir=job_folder(settings.resolved_checkpoint_dir, job_id),
                resume_from=resume_from,
                device=settings.device,
                sample_groups=settings.sample_groups_per_step,
                **agent_endpoints(spec),
            )
        except Exception as exc:  # judged below, once the heartbeat process has stopped
            error = exc
        # Still under the lease (its heartbeat goes on while the trackers flush).
        outcome = export_outcome(callbacks, error, lease.lost.is_set())
        close_exports(callbacks, outcome, settings.tracker_flush_seconds)
    # The heartbeat process has exited: from here on only this function ends the attempt.
    if isinstance(error, LeaseLost) or lease.lost.is_set():
        return "lease_lost"
    if error is not None:
        return _fail(ctx, job_id, attempt, error)
    assert result is not None
    return _record_outcome(ctx, job_id, attempt, result, callbacks.stop_reason)


def _record_outcome(
    ctx: WorkerContext, job_id: str, attempt: int, result: TrainOutcome, reason: str | None
) -> str:
    """Record how a run that returned ended, given why it was asked to stop (`reason`: a
    cancel, a pause, the worker's shutdown, or None): cancelled, paused (by its owner or by a
    guard of its own), handed back, or succeeded; the outcome word."""
    if reason == "cancelled" and result.stopped_early:
        _end(
            ctx,
            job_id,
            attempt,
            JobStatus.CANCELLED,
            message=f"cancelled at step {result.final_step}",
        )
        return "cancelled"
    # The run paused itself (a guard tripped): paused with its reason, resumable. (A test's
    # stand-in trainer may return an outcome without the attribute.)
    guard = getattr(result, "pause_reason", None)
    if (
        guard is not None
        and result.stopped_early
        and reason is None
        and pause(ctx.sessions, job_id, attempt, f"{guard} (at step {result.final_step})")
    ):
        ctx.tail.notify(job_id, "status")
        return "paused"
    if reason == "paused" and result.stopped_early:
        message = f"paused at step {result.final_step} (its checkpoint); resume to continue"
        if not pause(ctx.sessions, job_id, attempt, message):
            # The pause was taken back after the trainer stopped: hand the job back so that
            # the next claim continues it from the checkpoint just written.
            release(ctx.sessions, ctx.dispatcher, job_id, attempt, "resumed while stopping")
        ctx.tail.notify(job_id, "status")
        return "paused"
    if reason == "shutdown" and result.stopped_early:
        message = f"worker shut down at step {result.final_step}; re-queued"
        release(ctx.sessions, ctx.dispatcher, job_id, attempt, message)
        ctx.tail.notify(job_id, "status")
        return "released"
    _end(ctx, job_id, attempt, JobStatus.SUCCEEDED, message=f"finished {result.final_step} steps")
    return "succeeded"


def _fail(ctx: WorkerContext, job_id: str, attempt: int, error: Exception) -> str:
    """End the attempt as failed. A TrainerError's message is ours and meant for the user; any
    other error may carry server paths or internals, so the user gets a reference and the
    worker log gets the traceback under the same reference. A retryable reason (a rank died)
    hands the job back to the queue instead while it has attempts left."""
    if (again := retryable(error)) is not None:
        log.warning("job %s attempt %s: %s (%s)", job_id, attempt, again.reason, again)
        message = str(again)[:4000]
        outcome = retry(ctx.sessions, ctx.dispatcher, job_id, attempt, again.reason, message)
        ctx.tail.notify(job_id, "status")
        return outcome
    if isinstance(error, TrainerError):
        message, code = str(error)[:4000], error.reason
    else:
        reference = secrets.token_hex(6)
        log.error(
            "job %s attempt %s: trainer error (reference %s)",
            job_id,
            attempt,
            reference,
            exc_info=error,
        )
        message = (
            f"internal error in the trainer ({type(error).__name__}, reference {reference}); "
            f"the operator's worker log has the details under job {job_id}"
        )
        code = "trainer_error"
    _end(ctx, job_id, attempt, JobStatus.FAILED, message=message, error_code=code)
    return "failed"
