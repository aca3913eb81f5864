"""A job whose size class's workers all hold Tinker training clients (issue 44): a worker that
serves both takes no job while it holds one, so the job waits. The dry run warns of it, and a
job that has waited says why in one `tinker_held` event, naming what frees a worker
(GRPO_TINKER_IDLE_RELEASE_S) and what gives Tinker workers of their own (GRPO_WORKER_SERVES).

Before, the job sat `queued` without a word while every worker of its size answered Tinker
calls."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import update

from app.core.clock import utcnow
from app.core.db import session_scope
from app.core.models import Job
from app.jobs import size_classes
from tests.app.jobs.conftest import Deployment


def _waited(service: Deployment, job_id: str, seconds: float = 60) -> None:
    """The job was queued and sent `seconds` ago."""
    past = utcnow() - timedelta(seconds=seconds)
    with session_scope(service.sessions) as session:
        session.execute(
            update(Job).where(Job.id == job_id).values(dispatched_at=past, updated_at=past)
        )


def _sweep(service: Deployment) -> list[str]:
    """One maintenance pass's note (worker.maintenance.note_jobs_waiting_for_tinker)."""
    return size_classes.note_jobs_waiting_for_tinker(service.sessions, service.settings)


def _told(service: Deployment, job_id: str) -> list[dict[str, object]]:
    return [e for e in service.events(job_id) if e["type"] == "tinker_held"]


def test_a_job_waiting_for_workers_that_hold_tinker_clients_is_told_once(
    deployment: Callable[..., Deployment],
) -> None:
    service = deployment()
    service.worker_seen(1, tinker_models=2)
    service.worker_seen(1, tinker_models=1)

    (warning,) = service.validate(1)
    assert "all 2 worker(s) of 1 device(s) seen in the last 300 s hold Tinker" in warning
    assert "GRPO_TINKER_IDLE_RELEASE_S (180 s)" in warning and "GRPO_WORKER_SERVES" in warning

    job = service.create(1)["id"]
    assert service.dispatcher.sent == [job]
    assert job not in _sweep(service)  # just sent: a worker often frees itself soon
    _waited(service, job)
    assert job in _sweep(service)
    (event,) = _told(service, job)
    assert (event["level"], event["message"]) == ("warning", warning)
    assert event["data"] == {"devices": 1, "workers": 2, "tinker_idle_release_s": 180.0}

    assert job not in _sweep(service)  # once, not every pass
    assert len(_told(service, job)) == 1


def test_nothing_is_said_while_a_worker_of_the_size_is_free(
    deployment: Callable[..., Deployment],
) -> None:
    service = deployment()
    service.worker_seen(1, tinker_models=1)
    service.worker_seen(1)  # holds no Tinker client: it takes the job
    service.worker_seen(2, tinker_models=1)  # another size class, all held
    assert service.validate(1) == []

    job = service.create(1)["id"]
    _waited(service, job)
    assert job not in _sweep(service)
    assert _told(service, job) == []


def test_a_tinker_only_worker_is_no_size_class(deployment: Callable[..., Deployment]) -> None:
    """A worker with GRPO_WORKER_SERVES=tinker announces 0 devices: it takes no job, so it
    neither makes a size class known nor counts among a class's workers."""
    service = deployment()
    service.worker_seen(0, tinker_models=4)
    assert service.validate(1) == []  # no job-taking worker seen: nothing is known yet
    service.worker_seen(1)
    assert service.validate(1) == []
    (no_worker,) = service.validate(2)
    assert "the workers seen have 1 device(s)" in no_worker
