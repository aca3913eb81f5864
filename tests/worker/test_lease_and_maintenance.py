"""Lease fencing, the reaper and the re-dispatch sweep, driven in-process against the database."""

from __future__ import annotations

import secrets
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.ids import new_id
from app.core.models import Job, JobMetric
from app.core.queue import queue_for
from app.core.settings import Settings
from app.jobs import transitions
from app.jobs import workers_repository as workers_repo
from app.jobs.transitions import JobStatus
from tests.conftest import RecordingDispatcher, new_project_key
from trainer.run.callbacks import RunInfo
from worker import maintenance
from worker.context import WorkerContext
from worker.lease import LeaseKeeper
from worker.maintenance import reap_stale_jobs, redispatch_queued
from worker.progress import DatabaseCallbacks, LeaseLost
from worker.settings import build_worker_settings


@pytest.fixture
def ctx(settings: Settings) -> WorkerContext:
    worker_settings = build_worker_settings(
        data_dir=settings.data_dir,
        database_url=settings.resolved_database_url,
        lease_seconds=30,
        redispatch_seconds=30,
        max_attempts=2,
        db_retry_seconds=1,
    )
    engine = make_engine(worker_settings.resolved_database_url)
    dispatcher = RecordingDispatcher()
    dispatcher.sessions = make_session_factory(engine)
    return WorkerContext(worker_settings, dispatcher.sessions, dispatcher)


def make_job(ctx: WorkerContext, max_attempts: int = 2, queue: str = "grpo-jobs") -> str:
    _, project_id = new_project_key(ctx.settings)
    with session_scope(ctx.sessions) as session:
        job = Job(
            id=new_id("job"),
            project_id=project_id,
            spec={},
            created_at=utcnow(),
            updated_at=utcnow(),
            total_steps=4,
            max_attempts=max_attempts,
            queue=queue,
        )
        transitions.record_created(session, job)
        return job.id


def age(ctx: WorkerContext, job_id: str, seconds: float, *, heartbeat: bool = True) -> None:
    past = utcnow() - timedelta(seconds=seconds)
    values = {"updated_at": past, "dispatched_at": past}
    if heartbeat:
        values["heartbeat_at"] = past
    with session_scope(ctx.sessions) as session:
        session.execute(update(Job).where(Job.id == job_id).values(**values))


def job(ctx: WorkerContext, job_id: str) -> Job:
    with session_scope(ctx.sessions) as session:
        row = session.get(Job, job_id)
        assert row is not None
        return row


def claim(ctx: WorkerContext, job_id: str, owner: str = "w") -> int:
    with session_scope(ctx.sessions) as session:
        attempt = transitions.claim(session, job_id, owner)
    assert attempt is not None
    return attempt


def test_reaper_requeues_a_stale_job_then_fails_it_as_worker_lost(ctx: WorkerContext) -> None:
    job_id = make_job(ctx, max_attempts=2)
    claim(ctx, job_id)
    # (the embedded database is shared by the session: other tests' jobs may be reaped too)
    assert job_id not in reap_stale_jobs(ctx)  # fresh heartbeat: left alone
    age(ctx, job_id, 120)
    assert job_id in reap_stale_jobs(ctx)
    assert job(ctx, job_id).status == "queued"
    assert ctx.dispatcher.sent.count(job_id) == 1  # type: ignore[attr-defined]
    # sent once the re-queue was committed, and stamped for the sweep
    assert ctx.dispatcher.committed_status[job_id] == "queued"  # type: ignore[attr-defined]
    assert job(ctx, job_id).dispatched_at is not None
    assert claim(ctx, job_id) == 2
    age(ctx, job_id, 120)
    reap_stale_jobs(ctx)
    final = job(ctx, job_id)
    assert (final.status, final.error_code) == ("failed", "worker_lost")


def test_reaper_handles_a_job_that_never_heartbeated(ctx: WorkerContext) -> None:
    job_id = make_job(ctx)
    claim(ctx, job_id)
    with session_scope(ctx.sessions) as session:
        session.execute(update(Job).where(Job.id == job_id).values(heartbeat_at=None))
    age(ctx, job_id, 120, heartbeat=False)
    assert job_id in reap_stale_jobs(ctx)


def test_stale_cancelling_job_ends_cancelled(ctx: WorkerContext) -> None:
    job_id = make_job(ctx)
    claim(ctx, job_id)
    with session_scope(ctx.sessions) as session:
        transitions.transition(session, job_id, JobStatus.CANCELLING)
    age(ctx, job_id, 120)
    reap_stale_jobs(ctx)
    assert job(ctx, job_id).status == "cancelled"


def test_stale_pausing_job_ends_paused_without_spending_an_attempt(ctx: WorkerContext) -> None:
    job_id = make_job(ctx, max_attempts=2)
    claim(ctx, job_id)
    with session_scope(ctx.sessions) as session:
        transitions.transition(session, job_id, JobStatus.PAUSING)
    age(ctx, job_id, 120)
    assert job_id not in reap_stale_jobs(ctx)  # not re-queued: its owner asked for a pause
    paused = job(ctx, job_id)
    assert (paused.status, paused.lease_owner, paused.max_attempts) == ("paused", None, 3)
    assert job_id not in ctx.dispatcher.sent  # type: ignore[attr-defined]


def test_sweep_resends_queued_jobs_whose_message_may_be_lost(
    ctx: WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The database is shared with earlier tests, which leave waiting jobs of other projects;
    # one sweep sends at most SWEEP_BATCH, oldest first, so lift the bound to reach ours.
    monkeypatch.setattr(maintenance, "SWEEP_BATCH", 100_000)
    job_id = make_job(ctx, queue="gpu-jobs")  # committed, never sent (as after a failed send)
    assert job_id in redispatch_queued(ctx)  # its project has a free dispatch slot: sent
    assert job_id not in redispatch_queued(ctx)  # just sent: not yet suspicious
    age(ctx, job_id, 120)
    assert job_id in redispatch_queued(ctx)
    # back to the queue it was created for, not the queue this worker consumes
    assert ctx.dispatcher.queues[job_id] == "gpu-jobs"  # type: ignore[attr-defined]
    assert job_id not in redispatch_queued(ctx)  # dispatched_at refreshed by the send


def announce(ctx: WorkerContext, *, queue_name: str, devices: int, tinker_models: int = 0) -> None:
    """A worker of the deployment `queue_name` announces its size class, as each does every
    maintenance pass (worker.maintenance.announce_worker)."""
    with session_scope(ctx.sessions) as session:
        workers_repo.announce(
            session,
            name=f"worker-{secrets.token_hex(4)}",
            queue_name=queue_name,
            devices=devices,
            now=utcnow(),
            tinker_models=tinker_models,
        )


def test_sweep_sends_nothing_more_to_a_size_class_no_worker_runs(
    ctx: WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44: a job of a size no worker of its deployment announced got a new message every
    sweep, which piled up in a queue nobody consumes. It stays queued, with its one message,
    until a worker of its size announces itself; then the next sweep sends it."""
    monkeypatch.setattr(maintenance, "SWEEP_BATCH", 100_000)
    deployment = f"dep-{secrets.token_hex(3)}"
    announce(ctx, queue_name=deployment, devices=1)
    announce(ctx, queue_name=deployment, devices=0, tinker_models=2)  # Tinker only: no class
    job_id = make_job(ctx, queue=queue_for(deployment, 2))
    assert job_id in redispatch_queued(ctx)  # its first message, into its project's free slot
    for _ in range(2):
        age(ctx, job_id, 120)
        assert job_id not in redispatch_queued(ctx)
    assert ctx.dispatcher.sent.count(job_id) == 1  # type: ignore[attr-defined]
    assert job(ctx, job_id).status == "queued"

    announce(ctx, queue_name=deployment, devices=2)
    assert job_id in redispatch_queued(ctx)
    assert ctx.dispatcher.queues[job_id] == queue_for(deployment, 2)  # type: ignore[attr-defined]


def test_maintenance_tells_a_job_its_workers_hold_tinker_clients_once(
    ctx: WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44 (tests/app/jobs/test_tinker_held_workers.py has what the job's owner reads)."""
    monkeypatch.setattr(maintenance, "SWEEP_BATCH", 100_000)
    deployment = f"dep-{secrets.token_hex(3)}"
    announce(ctx, queue_name=deployment, devices=1, tinker_models=1)
    job_id = make_job(ctx, queue=deployment)
    assert job_id in redispatch_queued(ctx)
    assert job_id not in maintenance.note_jobs_waiting_for_tinker(ctx)  # not waited yet
    age(ctx, job_id, 60)
    assert job_id in maintenance.note_jobs_waiting_for_tinker(ctx)
    assert job_id not in maintenance.note_jobs_waiting_for_tinker(ctx)


def test_worker_that_lost_its_lease_writes_nothing(ctx: WorkerContext, tmp_path: Path) -> None:
    job_id = make_job(ctx, max_attempts=3)
    first = claim(ctx, job_id, "paused-worker")
    lease = LeaseKeeper(ctx.sessions, job_id, first, interval_s=60)
    callbacks = DatabaseCallbacks(ctx, job_id, first, lease)
    callbacks.on_step(1, {"reward/mean": 0.5})
    # the worker pauses; the reaper hands the job to another worker
    age(ctx, job_id, 120)
    reap_stale_jobs(ctx)
    second = claim(ctx, job_id, "new-worker")
    assert second == first + 1
    with pytest.raises(LeaseLost):
        callbacks.on_step(2, {"reward/mean": 0.9})
    with pytest.raises(LeaseLost):
        callbacks.on_checkpoint(2, tmp_path)
    assert callbacks.should_stop() and callbacks.stop_reason == "lease_lost"
    with session_scope(ctx.sessions) as session:
        steps = session.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id)).all()
    assert list(steps) == [1]


def test_metrics_are_written_once_per_step(ctx: WorkerContext, tmp_path: Path) -> None:
    job_id = make_job(ctx)
    attempt = claim(ctx, job_id)
    lease = LeaseKeeper(ctx.sessions, job_id, attempt, interval_s=60)
    callbacks = DatabaseCallbacks(ctx, job_id, attempt, lease)
    callbacks.on_start(RunInfo(4, 0, tmp_path, tmp_path, "cpu", "transformers"))
    for step in (1, 2, 2, 1, 3):  # a resumed attempt repeats steps
        callbacks.on_step(step, {"reward/mean": float(step), "kl": float("nan")})
    with session_scope(ctx.sessions) as session:
        rows = session.scalars(
            select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
        ).all()
        assert [r.step for r in rows] == [1, 2, 3]
        assert rows[0].values == {"reward/mean": 1.0, "kl": None}  # NaN stored as null
    assert job(ctx, job_id).current_step == 3


def test_should_stop_sees_a_cancel_at_once(ctx: WorkerContext) -> None:
    job_id = make_job(ctx)
    attempt = claim(ctx, job_id)
    lease = LeaseKeeper(ctx.sessions, job_id, attempt, interval_s=60)
    callbacks = DatabaseCallbacks(ctx, job_id, attempt, lease)
    assert callbacks.should_stop() is False
    with session_scope(ctx.sessions) as session:
        transitions.transition(session, job_id, JobStatus.CANCELLING)
    assert callbacks.should_stop() is True and callbacks.stop_reason == "cancelled"


def test_should_stop_sees_a_pause_at_once(ctx: WorkerContext) -> None:
    job_id = make_job(ctx)
    attempt = claim(ctx, job_id)
    lease = LeaseKeeper(ctx.sessions, job_id, attempt, interval_s=60)
    callbacks = DatabaseCallbacks(ctx, job_id, attempt, lease)
    assert callbacks.should_stop() is False
    with session_scope(ctx.sessions) as session:
        transitions.transition(session, job_id, JobStatus.PAUSING)
    assert callbacks.should_stop() is True and callbacks.stop_reason == "paused"


def test_maintenance_forgets_inference_processes_gone_for_an_hour(ctx: WorkerContext) -> None:
    """A `grpo inference` killed outright never removes its row; the maintenance pass does,
    once its heartbeat is an hour old, and leaves a live process's row alone (rows of gone
    processes stayed forever before)."""
    from app.core.models import InferenceServer
    from app.gateway import servers_repository

    with session_scope(ctx.sessions) as session:
        for server_id in ("gone", "alive"):
            servers_repository.register(
                session, server_id=server_id, control_url="http://x", bases=["b"], state={}
            )
        session.execute(
            update(InferenceServer)
            .where(InferenceServer.id == "gone")
            .values(heartbeat_at=utcnow() - timedelta(hours=1, minutes=1))
        )
    assert maintenance.forget_gone_inference_servers(ctx) == 1
    with session_scope(ctx.sessions) as session:
        left = session.scalars(select(InferenceServer.id)).all()
    assert left == ["alive"]
