"""Pause and resume: a paused job keeps its checkpoints and gives its worker back.

Pausing a queued job parks it at once. Pausing a running one asks its worker to stop (pausing);
the trainer finishes its step, writes a checkpoint, and the worker records the job as paused
and releases the lease, without counting the attempt against the job (worker.attempts.pause).
Resuming a paused job queues it again under the project's quota and fair dispatch, and the next
worker continues from the last checkpoint, as after any hand-over. Resuming a job that is still
pausing takes the pause back. Both are idempotent; a succeeded, cancelled or cancelling job is a
409. A failed job resumes as a paused one does: from its last checkpoint (its error cleared, the
operator's allowance of attempts given anew), so a job the mismatch guard or a lost worker ended
can follow the advice it was given.

A paused or failed job may resume with some settings changed (:func:`resume_with_changes`):
those the mismatch guard's advice names (the learning rate, the async staleness and the guard's
bounds) and how many steps it trains. The changes are written into the job's spec in the same
compare-and-set that queues it again, so the next worker trains the changed spec from the last
checkpoint (trainer.run.checkpoints says what each change does there).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.core.errors import Conflict, IllegalTransition, InvalidRequest
from app.core.field_paths import field_path
from app.core.models import Job
from app.core.queue import Dispatcher
from app.core.settings import Settings
from app.jobs import admission, transitions
from app.jobs import repository as jobs_repo
from app.jobs import service as jobs_service
from app.jobs.dispatch import send_after_commit, withdraw_after_commit
from app.jobs.quota import ActiveLimits, check_active_jobs
from app.jobs.transitions import JobStatus
from jobspec import JobSpec

# What a paused job may change when it resumes, as paths into its spec. Anything else (the
# model, the data, the group size...) would no longer be the run its checkpoints belong to.
RESUME_SETTINGS = (
    "grpo.learning_rate",
    "grpo.steps",
    "grpo.async.max_staleness",
    "grpo.async.max_mismatch",
    "grpo.async.max_capped_frac",
)


def _settle(session: Session, job: Job, act: Callable[[JobStatus], None], verb: str) -> Job:
    """Run `act` on the job's current status, re-reading and retrying when a worker changed it
    concurrently (the compare-and-set then wrote nothing); the job as it is afterwards."""
    for _ in range(3):
        try:
            act(JobStatus(job.status))
        except _Refused as refused:
            # 409 of type invalid_state: final, unlike the "changing state" conflict below,
            # which a client retries.
            raise IllegalTransition(str(refused), param="job_id") from None
        except IllegalTransition:
            jobs_repo.reload(session, job=job)
            continue
        return jobs_repo.reload(session, job=job)
    raise Conflict(f"job {job.id} is changing state; retry the {verb}", param="job_id")


class _Refused(Exception):
    """The job's state rules the action out for good (not a race to retry)."""


def _refuse(job: Job, status: JobStatus, verb: str) -> _Refused:
    why = "has ended" if status in transitions.TERMINAL else "is being cancelled"
    return _Refused(f"job {job.id} {why} ({status}); it cannot be {verb}d")


def pause_job(session: Session, *, job: Job) -> Job:
    """Queued -> paused at once; running -> pausing (its worker stops within a step and records
    it paused); pausing or paused: returned as is."""

    def act(status: JobStatus) -> None:
        if status == JobStatus.QUEUED:
            transitions.transition(session, job.id, JobStatus.PAUSED, message="paused while queued")
            if job.dispatched_at is not None:  # its message leaves the broker (a resume sends anew)
                withdraw_after_commit(session, job_id=job.id, queue=job.queue)
        elif status == JobStatus.RUNNING:
            transitions.transition(session, job.id, JobStatus.PAUSING, message="pause requested")
        elif status not in (JobStatus.PAUSING, JobStatus.PAUSED):
            raise _refuse(job, status, "pause")

    return _settle(session, job, act, "pause")


def resume_job(session: Session, *, job: Job, dispatcher: Dispatcher, settings: Settings) -> Job:
    """Paused or failed -> queued, within the project's quota of active jobs and their devices
    (429 beyond it) and sent, to the queue it was created for, after the commit when the
    project has a free dispatch slot; pausing -> running (the pause is taken back); queued or
    running: returned as is. A failed job continues from its last checkpoint with a fresh
    allowance of attempts (:func:`_requeue`)."""

    def act(status: JobStatus) -> None:
        if status in RESUMABLE:
            _requeue(session, job, status, dispatcher, settings, message="resumed")
        elif status == JobStatus.PAUSING:
            transitions.transition(
                session, job.id, JobStatus.RUNNING, message="resumed before it paused"
            )
        elif status not in (JobStatus.QUEUED, JobStatus.RUNNING):
            raise _refuse(job, status, "resume")

    return _settle(session, job, act, "resume")


# What a resume queues again: a paused job, and a failed one (its checkpoints are kept: the
# mismatch guard's advice, a worker lost once too often, an error fixed since).
RESUMABLE = (JobStatus.PAUSED, JobStatus.FAILED)


def _requeue(
    session: Session,
    job: Job,
    status: JobStatus,
    dispatcher: Dispatcher,
    settings: Settings,
    *,
    message: str,
    values: dict[str, Any] | None = None,
) -> None:
    """Paused or failed -> queued (with ``values`` written in the same compare-and-set) under
    the project's quota, sent after the commit. A failed job leaves its error and end behind
    and gets the operator's allowance of attempts anew (its attempt number goes on: events and
    leases stay ordered); a job deleted meanwhile is not resumed."""
    changes = dict(values or {})
    if status == JobStatus.FAILED:
        message = f"{message} after it failed ({job.error_code}), from its last checkpoint"
        changes |= {
            "finished_at": None,
            "error_code": None,
            "error_message": None,
            "max_attempts": job.attempt + settings.max_attempts,
        }
    transitions.transition(
        session,
        job.id,
        JobStatus.QUEUED,
        message=message,
        values=changes,
        only_if=[Job.deleted_at.is_(None)],
    )
    limits = ActiveLimits.of(settings)
    held = check_active_jobs(session, project_id=job.project_id, limits=limits, queue=job.queue)
    send_after_commit(session, dispatcher, job_id=job.id, queue=job.queue, slots_held=held)


def resume_with_changes(
    session: Session,
    *,
    job: Job,
    changes: Mapping[str, Any],
    dispatcher: Dispatcher,
    settings: Settings,
) -> Job:
    """Paused or failed -> queued with ``changes`` (paths of :data:`RESUME_SETTINGS` ->
    values) written into its spec, validated as a new job's spec is (a 422 naming the field).
    A job that is queued or running already with exactly these settings is returned as is (a
    retried request); pausing is a 409 to retry once it is paused; any other state is a 409."""
    spec = changed_spec(session, job, changes, settings)
    before = {path: _at(job.spec, path) for path in changes}
    after = {path: _at(spec, path) for path in changes}

    def act(status: JobStatus) -> None:
        if status in RESUMABLE:
            moved = ", ".join(f"{p} {before[p]} -> {after[p]}" for p in changes)
            _requeue(
                session,
                job,
                status,
                dispatcher,
                settings,
                message=f"resumed with {moved}" if moved else "resumed",
                values={"spec": spec, "total_steps": spec["grpo"]["steps"]},
            )
        elif status in (JobStatus.QUEUED, JobStatus.RUNNING):
            if any(_at(job.spec, path) != value for path, value in after.items()):
                raise _Refused(
                    f"job {job.id} is {status}, not paused: its settings change only while it "
                    "is paused or failed (pause it first)"
                )  # else: this resume already happened (a retried request)
        elif status == JobStatus.PAUSING:
            raise Conflict(
                f"job {job.id} is still pausing; resume it with changes once it is paused",
                param="job_id",
            )
        else:
            raise _refuse(job, status, "resume")

    return _settle(session, job, act, "resume")


def changed_spec(
    session: Session, job: Job, changes: Mapping[str, Any], settings: Settings
) -> dict[str, Any]:
    """The job's stored spec with ``changes`` applied, as stored: checked as a new job's spec
    is (the spec's own rules, the operator's size limits, the memory plan), each refusal a 422
    naming the field."""
    for path in changes:
        if path not in RESUME_SETTINGS:
            raise InvalidRequest(
                f"{path}: cannot be changed on resume; a resume may set "
                f"{', '.join(RESUME_SETTINGS)}",
                param=path,
            )
    stored = copy.deepcopy(job.spec)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = stored
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    try:
        spec = JobSpec.model_validate(stored)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = field_path(error.get("loc", ()))
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        raise InvalidRequest(f"{param}: {message}", param=param) from None
    _check_size(session, job, spec, settings)
    resolved = spec.model_dump(mode="json")
    for path in changes:  # as validated (a number given as text, stored as the number)
        *parents, leaf = path.split(".")
        _node(stored, parents)[leaf] = _at(resolved, path)
    return stored


def _check_size(session: Session, job: Job, spec: JobSpec, settings: Settings) -> None:
    """What the changes may break that the spec alone does not say: fewer steps than the job
    has trained, the operator's limits on its size, the memory plan of its devices."""
    if spec.grpo.steps < job.current_step:
        raise InvalidRequest(
            f"grpo.steps: {spec.grpo.steps} is below the {job.current_step} steps the job "
            "has trained",
            param="grpo.steps",
        )
    admission.admit_limits(spec, settings)
    jobs_service.check_plan_fits(spec, settings, session)


def _node(spec: dict[str, Any], names: list[str]) -> dict[str, Any]:
    for name in names:
        spec = spec[name]
    return spec


def _at(spec: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted path of a stored spec (None when absent)."""
    node: Any = spec
    for name in path.split("."):
        node = node.get(name) if isinstance(node, Mapping) else None
    return node
