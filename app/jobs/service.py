"""Job rules: create (idempotent, whole in `JobCreation`; sent to the broker after the commit;
refused when its memory plan does not fit), read, cancel.

Everything here runs inside the caller's unit of work and only flushes; the request boundary
(app.core.deps.get_session) commits. The one exception is the idempotency claim, see `_claim_key`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.core import db
from app.core.clock import utcnow
from app.core.errors import (
    Conflict,
    IllegalTransition,
    InvalidRequest,
    NotFound,
)
from app.core.ids import new_id
from app.core.models import File, Job
from app.core.queue import Dispatcher, queue_for
from app.core.settings import Settings
from app.datasets import repository as files_repo
from app.datasets import service as datasets_service
from app.jobs import admission, transitions
from app.jobs import repository as jobs_repo
from app.jobs.dispatch import send_after_commit, withdraw_after_commit
from app.jobs.idempotency import Replay, claim_for_request, record_response, spec_fingerprint
from app.jobs.quota import ActiveLimits, check_active_jobs
from app.jobs.size_classes import SizeClassWatch, record_warning
from app.jobs.transitions import JobStatus
from jobspec import MAX_HOLDOUT_ROWS, MAX_INLINE_ROWS, JobSpec
from jobspec.memory_plan import MemoryPlan, PlanInputs, plan_memory, refusal
from jobspec.model_shape import lookup_shape


def dataset_file(session: Session, *, project_id: str, spec: JobSpec) -> File | None:
    """The uploaded file the spec's dataset names (None when it names none); a 422 naming
    `dataset.file_id` when it is not this project's."""
    file_id = spec.dataset.file_id
    if file_id is None:
        return None
    row = files_repo.get_for_project(session, project_id=project_id, file_id=file_id)
    if row is None:
        raise InvalidRequest(f"file {file_id} not found", param="dataset.file_id")
    return row


def check_validation_file(
    session: Session, *, project_id: str, spec: JobSpec, train_rows: int | None
) -> File | None:
    """The file the spec's ``dataset.validation_file_id`` names (None when it names none); a
    422 naming that field when it is not this project's, or when training and validation rows
    together exceed what one job may hold (the worker appends them as the held-out set)."""
    file_id = spec.dataset.validation_file_id
    if file_id is None:
        return None
    param = "dataset.validation_file_id"
    row = files_repo.get_for_project(session, project_id=project_id, file_id=file_id)
    if row is None:
        raise InvalidRequest(f"file {file_id} not found", param=param)
    if row.row_count > MAX_HOLDOUT_ROWS:
        raise InvalidRequest(
            f"validation file has {row.row_count} rows; at most {MAX_HOLDOUT_ROWS} are evaluated",
            param=param,
        )
    if train_rows is not None and train_rows + row.row_count > MAX_INLINE_ROWS:
        raise InvalidRequest(
            f"training ({train_rows}) and validation ({row.row_count}) rows together exceed "
            f"{MAX_INLINE_ROWS}",
            param=param,
        )
    return row


def memory_plan(
    spec: JobSpec, settings: Settings, session: Session, watch: SizeClassWatch | None = None
) -> tuple[MemoryPlan | None, str | None]:
    """The job's memory plan on its workers' device (GRPO_WORKER_DEVICE_MEMORY_GIB and _KIND,
    else what the workers of its size class announced, read through `watch` when given, the
    process's cached read, else this host's), or None and why (no config.json to read)."""
    forbid = [settings.data_dir.resolve(), settings.resolved_checkpoint_dir]
    roots, rev = settings.model_root_list, spec.model_revision
    shape, reason = lookup_shape(spec.model, revision=rev, roots=roots, forbidden=forbid)
    if shape is None:
        return None, reason
    announced = None
    if not settings.declares_worker_device():
        seen = (watch or SizeClassWatch(settings)).seen(session)
        announced = seen.device_of(queue_for(settings.queue_name, spec.resources.devices))
    memory, kind = settings.worker_device_memory(announced)
    inputs, devices = PlanInputs.from_spec(spec, kind), settings.max_devices_per_job
    return plan_memory(shape, inputs, device_memory=memory, max_devices=devices), None


def check_plan_fits(
    spec: JobSpec, settings: Settings, session: Session, watch: SizeClassWatch | None = None
) -> None:
    """A 422 naming ``model``, with the plan's suggested fixes, for a job its workers'
    devices cannot hold (:func:`memory_plan`); nothing when it fits or cannot be planned."""
    plan, _ = memory_plan(spec, settings, session, watch)
    if plan is not None and not plan.fits:
        message, fixes = refusal(plan)
        raise InvalidRequest(message, param="model", details=fixes)


def _admit_and_dispatch_at_commit(
    session: Session,
    *,
    dispatcher: Dispatcher,
    project_id: str,
    job_id: str,
    queue: str,
    limits: ActiveLimits,
) -> None:
    """The new job's last work before the commit: the quota, then its send after the commit,
    decided on the dispatch slots counted under the same lock."""
    dispatched = check_active_jobs(session, project_id=project_id, limits=limits, queue=queue)
    # Only after the commit: a worker can never receive an id it cannot read.
    send_after_commit(
        session, dispatcher, job_id=job_id, queue=queue, created=True, slots_held=dispatched
    )


def create_job(
    session: Session,
    *,
    claims: sessionmaker[Session],
    dispatcher: Dispatcher,
    project_id: str,
    spec: JobSpec,
    idempotency_key: str | None,
    idempotency_ttl: timedelta,
    max_attempts: int,
    queue: str,
    settings: Settings,
    openai: dict[str, Any] | None = None,
    fingerprint: str | None = None,
    watch: SizeClassWatch | None = None,
) -> Job | Replay:
    """A new queued job, sent to `queue` (its size class's, app.core.queue.queue_for, for every
    re-send too) once the request commits; or, for a retry with the same Idempotency-Key and
    spec, the first request's stored response. With a key, the caller hands the response it
    sends to `record_response` in the same unit of work, so the job and its replayable response
    commit together; `claims` makes the key's own transactions (app.jobs.idempotency). The
    quota of active jobs and devices is checked at the commit (app.jobs.quota): a refusal rolls
    all back and releases the key. `openai` is stored with a job created through the
    OpenAI-compatible API (its request's own words); `fingerprint` replaces the resolved spec's
    as what a key's retries must match (that API fills a missing seed at random, so its body is
    stable). `watch` reads the workers' announced devices for the memory plan
    (:func:`memory_plan`)."""
    resolved = spec.model_dump(mode="json")  # the spec as stored, and what the key fingerprints
    if idempotency_key is not None:
        replay = claim_for_request(
            session,
            claims,
            project_id=project_id,
            key=idempotency_key,
            fingerprint=fingerprint or spec_fingerprint(resolved),
            ttl=idempotency_ttl,
        )
        if replay is not None:
            return replay
    train_file = dataset_file(session, project_id=project_id, spec=spec)
    train_rows = train_file.row_count if train_file is not None else spec.dataset.known_row_count()
    check_validation_file(session, project_id=project_id, spec=spec, train_rows=train_rows)
    # What this operator allows (model folders, job size): after the claim, so a refusal rolls
    # back and releases the key like any other 4xx.
    admission.admit(spec, settings=settings, project_id=project_id, session=session)
    check_plan_fits(spec, settings, session, watch)
    now = utcnow()
    job = Job(
        id=new_id("job"),
        project_id=project_id,
        name=spec.name,
        # Large inline rows are stored as a file of the project (files.spill_inline_rows).
        spec=datasets_service.spill_inline_rows(session, project_id=project_id, spec=resolved),
        attempt=0,
        max_attempts=max_attempts,
        queue=queue,
        devices=spec.resources.devices,
        created_at=now,
        updated_at=now,
        total_steps=spec.grpo.steps,
        openai=openai,
    )
    transitions.record_created(session, job)
    db.before_commit(
        session,
        functools.partial(
            _admit_and_dispatch_at_commit,
            dispatcher=dispatcher,
            project_id=project_id,
            job_id=job.id,
            queue=queue,
            limits=ActiveLimits.of(settings),
        ),
    )
    return job


@dataclass(frozen=True)
class Answer:
    """What a create answers: the body and its status code; `replayed` when it is the stored
    first answer of an idempotent retry, sent again byte for byte."""

    status_code: int
    body: dict[str, Any]
    replayed: bool = False


class JobCreation:
    """The idempotent create, whole in one call: claim the Idempotency-Key (or answer a retry
    with the stored first answer), create the job, render and record the answer for the key's
    retries, in the caller's unit of work. Built once per process (app.core.state) and handed
    to every create route (app.jobs.deps.JobCreationDep), so no route can forget half of it."""

    def __init__(
        self, *, claims: sessionmaker[Session], dispatcher: Dispatcher, settings: Settings
    ) -> None:
        self.claims = claims
        self.dispatcher = dispatcher
        self.settings = settings
        # Which size classes the deployment's workers have (a job of another waits for good).
        self.size_classes = SizeClassWatch(settings)

    def create(
        self,
        session: Session,
        *,
        project_id: str,
        spec: JobSpec,
        idempotency_key: str | None,
        render: Callable[[Job], dict[str, Any]],
        status_code: int,
        openai: dict[str, Any] | None = None,
        fingerprint: str | None = None,
        warnings_field: str | None = None,
    ) -> Answer:
        """`render` turns the new job into the answer's body, sent with `status_code`; `openai`
        and `fingerprint` as in `create_job`. A creation warning (no worker of the job's size:
        app.jobs.size_classes) is the job's event, and the body's `warnings_field` if named."""
        created = create_job(
            session,
            claims=self.claims,
            dispatcher=self.dispatcher,
            project_id=project_id,
            spec=spec,
            idempotency_key=idempotency_key,
            idempotency_ttl=timedelta(hours=self.settings.idempotency_ttl_hours),
            max_attempts=self.settings.max_attempts,
            # The queue of the job's size class, which only workers of that size consume.
            queue=queue_for(self.settings.queue_name, spec.resources.devices),
            settings=self.settings,
            openai=openai,
            fingerprint=fingerprint,
            watch=self.size_classes,
        )
        if isinstance(created, Replay):
            return Answer(created.status_code, created.body, replayed=True)
        warnings = self._warn(session, created)
        body = render(created)
        if warnings_field is not None:
            body[warnings_field] = warnings
        record_response(
            session,
            project_id=project_id,
            idempotency_key=idempotency_key,
            status_code=status_code,
            body=body,
        )
        return Answer(status_code, body)

    def _warn(self, session: Session, job: Job) -> list[str]:
        """The creation's warnings, each recorded as the job's event."""
        warning = self.size_classes.warning(session, devices=job.devices)
        if warning is None:
            return []
        record_warning(session, job_id=job.id, devices=job.devices, message=warning)
        return [warning]


def get_job(session: Session, *, project_id: str, job_id: str) -> Job:
    """The project's job, or NotFound naming `job_id` (another project's job is not found)."""
    job = jobs_repo.get_for_project(session, project_id=project_id, job_id=job_id)
    if job is None:
        raise NotFound(f"job {job_id} not found", param="job_id")
    return job


def cancel_job(session: Session, *, job: Job) -> Job:
    """Idempotent: a queued or paused job is cancelled at once (a queued job's message leaves
    the broker after the commit), a running (or pausing) one is asked to stop (cancelling, the
    worker ends it within a step), a finished one is returned as is."""
    for _ in range(3):  # the worker may change the status under us; re-read and decide again
        status = JobStatus(job.status)
        try:
            if status in (JobStatus.QUEUED, JobStatus.PAUSED):
                transitions.transition(
                    session, job.id, JobStatus.CANCELLED, message=f"cancelled while {status}"
                )
                if status == JobStatus.QUEUED and job.dispatched_at is not None:
                    withdraw_after_commit(session, job_id=job.id, queue=job.queue)
            elif status in (JobStatus.RUNNING, JobStatus.PAUSING):
                transitions.transition(
                    session, job.id, JobStatus.CANCELLING, message="cancel requested"
                )
        except IllegalTransition:
            # The compare-and-set matched nothing, so this transaction wrote nothing: no
            # rollback needed, only a fresh read of what the worker did.
            jobs_repo.reload(session, job=job)
            continue
        return jobs_repo.reload(session, job=job)
    raise Conflict(f"job {job.id} is changing state; retry the cancel", param="job_id")
