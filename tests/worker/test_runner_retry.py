"""worker.runner.run_job when a job on several devices loses a rank: the retryable failure
reasons (worker.stop_reasons.RETRYABLE_REASONS) hand the attempt back to the queue, counted,
and the next attempt resumes from the last checkpoint; a job that always loses a rank fails
with the reason once its attempts are used. In process, with fake trainers (as
tests/worker/test_runner.py), on Postgres and SQLite. Also: which trainer a job's device count
gets."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.models import JobEvent
from app.core.settings import Settings
from jobspec import JobSpec
from tests.conftest import RecordingDispatcher
from tests.worker.test_runner import _control, fake_trainer, job, make_job, metric_steps
from trainer.errors import RankFailed, TrainerError
from trainer.run.callbacks import Callbacks, RunInfo
from worker.context import WorkerContext
from worker.runner import Train, load_trainer, run_job
from worker.settings import build_worker_settings
from worker.stop_reasons import RETRYABLE_REASONS


@pytest.fixture
def ctx(settings: Settings, tmp_path: Path) -> WorkerContext:
    worker_settings = build_worker_settings(
        data_dir=settings.data_dir,
        database_url=settings.resolved_database_url,
        checkpoint_dir=tmp_path / "checkpoints",
        worker_name="runner-under-test",
        max_attempts=2,
        db_retry_seconds=1,
    )
    engine = make_engine(worker_settings.resolved_database_url)
    return WorkerContext(worker_settings, make_session_factory(engine), RecordingDispatcher())


def loses_a_rank(reason: str, after: int = 2, before_failing: Any = None) -> Train:
    """Trains `after` steps, checkpoints the last, then fails as a launch whose rank died."""

    def train(
        spec: JobSpec,
        callbacks: Callbacks,
        *,
        output_dir: Path,
        resume_from: Path | None,
        device: str,
        sample_groups: int,
    ) -> Any:
        callbacks.on_start(RunInfo(3, 0, Path("/model"), output_dir, device, "fake"))
        for step in range(1, after + 1):
            callbacks.on_step(step, {"reward/mean": 0.5})
        checkpoint = output_dir / f"checkpoint-{after}"
        checkpoint.mkdir(parents=True, exist_ok=True)
        callbacks.on_checkpoint(after, checkpoint)
        if before_failing is not None:
            before_failing()
        raise TrainerError(f"rank 1 failed ({reason})", reason=reason)

    return train


def events(ctx: WorkerContext, job_id: str) -> list[JobEvent]:
    with session_scope(ctx.sessions) as session:
        query = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
        return list(session.scalars(query))


@pytest.mark.parametrize("reason", sorted(RETRYABLE_REASONS))
def test_a_lost_rank_hands_the_job_back_and_the_next_attempt_resumes(
    ctx: WorkerContext, reason: str
) -> None:
    job_id = make_job(ctx, queue="gpu-jobs")
    assert run_job(ctx, job_id, train=loses_a_rank(reason)) == "requeued"
    handed_back = job(ctx, job_id)
    assert (handed_back.status, handed_back.lease_owner, handed_back.attempt) == ("queued", None, 1)
    assert handed_back.max_attempts == 2  # the attempt counts, unlike a shutdown's hand-over
    assert handed_back.error_code is None  # not failed: nothing to show as the job's error
    assert ctx.dispatcher.sent == [job_id]  # type: ignore[attr-defined]
    assert ctx.dispatcher.queues[job_id] == "gpu-jobs"  # type: ignore[attr-defined]
    last = events(ctx, job_id)[-1]
    assert (last.type, last.level) == ("status", "warning")
    assert last.message.startswith(f"{reason}: rank 1 failed ({reason}); re-queued")

    calls: list[dict[str, Any]] = []
    assert run_job(ctx, job_id, train=fake_trainer(3, calls=calls)) == "succeeded"
    assert calls[0]["resume_from"].name == "checkpoint-2"
    final = job(ctx, job_id)
    assert (final.status, final.attempt) == ("succeeded", 2)
    assert metric_steps(ctx, job_id) == [1, 2, 3]


def test_a_job_that_always_loses_a_rank_fails_as_rank_failed_when_out_of_attempts(
    ctx: WorkerContext,
) -> None:
    job_id = make_job(ctx)  # max_attempts 2
    assert run_job(ctx, job_id, train=loses_a_rank("rank_failed")) == "requeued"
    assert run_job(ctx, job_id, train=loses_a_rank("rank_failed")) == "failed"
    final = job(ctx, job_id)
    assert (final.status, final.attempt, final.error_code) == ("failed", 2, "rank_failed")
    assert final.error_message == "rank 1 failed (rank_failed) (attempt 2 of 2; none left)"
    # and no further delivery claims it
    assert run_job(ctx, job_id, train=fake_trainer(3)) == "not_claimed"


@pytest.mark.parametrize(("action", "ends"), [("cancel", "cancelled"), ("pause", "paused")])
def test_a_lost_rank_while_cancelling_or_pausing_ends_as_the_user_asked(
    ctx: WorkerContext, action: str, ends: str
) -> None:
    job_id = make_job(ctx)

    def user_acts() -> None:
        if action == "pause":
            assert _control(ctx, job_id, "pause") == "pausing"
        else:
            from app.jobs import service as jobs_service

            with session_scope(ctx.sessions) as session:
                row = jobs_service.get_job(
                    session, project_id=job(ctx, job_id).project_id, job_id=job_id
                )
                assert jobs_service.cancel_job(session, job=row).status == "cancelling"

    assert run_job(ctx, job_id, train=loses_a_rank("rank_failed", 2, user_acts)) == ends
    final = job(ctx, job_id)
    assert (final.status, final.attempt, final.error_code) == (ends, 1, None)
    if ends == "paused":
        assert (final.lease_owner, final.max_attempts) == (None, 3)  # as the reaper pauses
    assert ctx.dispatcher.sent == []  # type: ignore[attr-defined]


def test_any_other_trainer_error_still_fails_at_once(ctx: WorkerContext) -> None:
    job_id = make_job(ctx)
    assert run_job(ctx, job_id, train=loses_a_rank("prompts_too_long")) == "failed"
    assert job(ctx, job_id).error_code == "prompts_too_long"


def test_the_retryable_reasons_are_the_launchers_the_worlds_and_the_rollout_servers() -> None:
    from trainer.distributed.world import DistributedTimeout
    from trainer.rollout.rollout_server import RolloutServerKilled
    from trainer.run.relay import RelayTimeout

    reasons = {RankFailed.reason, DistributedTimeout.reason, RelayTimeout.reason}
    assert reasons | {RolloutServerKilled.reason} == set(RETRYABLE_REASONS)


def test_a_job_on_several_devices_gets_the_launcher_and_one_device_the_loop() -> None:
    from trainer.run.launch import launch_ranks
    from trainer.run.loop import train

    assert load_trainer() is train
    assert load_trainer(1) is train
    launcher = load_trainer(4)
    assert isinstance(launcher, functools.partial)
    assert (launcher.func, launcher.keywords) == (launch_ranks, {"nproc": 4})
