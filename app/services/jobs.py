"""Job rules: create (idempotent, enqueue after commit), read, list, cancel."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from app import transitions
from app.clock import as_utc, utcnow
from app.db import session_scope
from app.errors import (
    Conflict,
    IdempotencyKeyReused,
    IllegalTransition,
    InvalidRequest,
    NotFound,
)
from app.ids import new_id
from app.models import File, IdempotencyRecord, Job
from app.queue import Dispatcher
from app.repositories import idempotency as idem_repo
from app.repositories import jobs as jobs_repo
from app.services.dispatch import send_job
from app.services.presenters import job_out
from app.transitions import JobStatus
from trainer.config import JobSpec

# An in-progress idempotency claim older than this belongs to a request that died mid-way.
STALE_CLAIM = timedelta(seconds=60)


@dataclass(frozen=True)
class CreateOutcome:
    status_code: int
    body: dict[str, Any]
    replayed: bool


def spec_fingerprint(raw_body: dict[str, Any]) -> str:
    """Hash of the request body as sent (key order does not matter)."""
    canonical = json.dumps(raw_body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _claim_key(
    factory: sessionmaker[Session], project_id: str, key: str, fingerprint: str, ttl: timedelta
) -> CreateOutcome | None:
    """Claim the idempotency key in its own committed transaction.

    Returns the stored outcome for a replay, raises for a mismatch or a request still in flight,
    or returns None when this request owns the key and must do the work."""
    now = utcnow()
    with session_scope(factory) as session:
        idem_repo.delete_older_than(session, project_id, key, now - ttl)
    try:
        with session_scope(factory) as session:
            session.add(
                IdempotencyRecord(
                    project_id=project_id,
                    key=key,
                    request_hash=fingerprint,
                    state="in_progress",
                    created_at=now,
                )
            )
        return None
    except IntegrityError:
        pass
    with session_scope(factory) as session:
        record = idem_repo.get(session, project_id, key)
        if record is None:  # expired and deleted between our two statements: try once more
            raise Conflict(
                "idempotency key is being reused concurrently; retry", param="Idempotency-Key"
            )
        if record.request_hash != fingerprint:
            raise IdempotencyKeyReused(
                "this Idempotency-Key was used with a different request body",
                param="Idempotency-Key",
            )
        if record.state != "completed":
            created = as_utc(record.created_at) or now
            if now - created > STALE_CLAIM:
                idem_repo.release(session, project_id, key)
                raise Conflict(
                    "an earlier request with this Idempotency-Key did not finish; retry",
                    param="Idempotency-Key",
                )
            raise Conflict(
                "a request with this Idempotency-Key is still in progress",
                param="Idempotency-Key",
            )
        return CreateOutcome(record.response_status or 201, record.response_body or {}, True)


def dataset_file(session: Session, project_id: str, spec: JobSpec) -> File | None:
    """The uploaded file the spec's dataset names (None when it names none); a 422 naming
    `dataset.file_id` when it is not this project's."""
    file_id = spec.dataset.file_id
    if file_id is None:
        return None
    row = session.get(File, file_id)
    if row is None or row.project_id != project_id:
        raise InvalidRequest(f"file {file_id} not found", param="dataset.file_id")
    return row


def create_job(
    factory: sessionmaker[Session],
    dispatcher: Dispatcher,
    *,
    project_id: str,
    spec: JobSpec,
    raw_body: dict[str, Any],
    idempotency_key: str | None,
    idempotency_ttl: timedelta,
    max_attempts: int,
    queue: str,
) -> CreateOutcome:
    fingerprint = spec_fingerprint(raw_body)
    if idempotency_key is not None:
        replay = _claim_key(factory, project_id, idempotency_key, fingerprint, idempotency_ttl)
        if replay is not None:
            return replay
    try:
        with session_scope(factory) as session:
            dataset_file(session, project_id, spec)
            now = utcnow()
            job = Job(
                id=new_id("job"),
                project_id=project_id,
                name=spec.name,
                spec=spec.model_dump(mode="json"),
                attempt=0,
                max_attempts=max_attempts,
                queue=queue,
                created_at=now,
                updated_at=now,
                total_steps=spec.grpo.steps,
            )
            transitions.record_created(session, job)
            job_id = job.id
    except BaseException:
        if idempotency_key is not None:
            with session_scope(factory) as session:
                idem_repo.release(session, project_id, idempotency_key)
        raise
    # Only after the commit: a worker can never receive an id it cannot read.
    send_job(factory, dispatcher, job_id, queue)
    with session_scope(factory) as session:
        body = job_out(_require(session, project_id, job_id)).model_dump(mode="json")
        if idempotency_key is not None:
            idem_repo.complete(session, project_id, idempotency_key, 201, body)
    return CreateOutcome(201, body, False)


def _require(session: Session, project_id: str, job_id: str) -> Job:
    job = jobs_repo.get_for_project(session, project_id, job_id)
    if job is None:
        raise NotFound(f"job {job_id} not found", param="job_id")
    return job


def get_job(session: Session, project_id: str, job_id: str) -> Job:
    return _require(session, project_id, job_id)


def cancel_job(session: Session, project_id: str, job_id: str) -> Job:
    """Idempotent: a queued job is cancelled at once, a running one is asked to stop
    (cancelling, the worker ends it within a step), a finished one is returned as is."""
    for _ in range(3):  # the worker may change the status under us; re-read and decide again
        job = _require(session, project_id, job_id)
        status = JobStatus(job.status)
        try:
            if status == JobStatus.QUEUED:
                transitions.transition(
                    session, job_id, JobStatus.CANCELLED, message="cancelled while queued"
                )
            elif status == JobStatus.RUNNING:
                transitions.transition(
                    session, job_id, JobStatus.CANCELLING, message="cancel requested"
                )
        except IllegalTransition:
            session.rollback()
            session.expire_all()
            continue
        session.commit()
        session.refresh(job)
        return job
    raise Conflict(f"job {job_id} is changing state; retry the cancel", param="job_id")
