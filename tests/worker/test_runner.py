"""worker.runner.run_job in process, with fake trainers: plain functions that drive the real
database callbacks the way trainer.run.loop.train does. Each outcome of a job attempt, on Postgres
and on SQLite, in seconds: no worker process, no broker, no model."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.ids import new_id
from app.core.models import Checkpoint, File, Job, JobEvent, JobMetric
from app.core.settings import Settings
from app.jobs import pausing, transitions
from app.jobs import service as jobs_service
from app.jobs.transitions import JobStatus
from jobspec import JobSpec
from tests.conftest import RecordingDispatcher, new_project_key, tiny_spec
from trainer.errors import TrainerError
from trainer.run.callbacks import Callbacks, RunInfo
from worker.context import WorkerContext
from worker.progress import LeaseLost
from worker.runner import Train, run_job
from worker.settings import build_worker_settings


@dataclass
class FakeResult:
    final_step: int
    stopped_early: bool = False


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


def make_job(
    ctx: WorkerContext,
    spec: dict[str, object] | None = None,
    queue: str = "gpu-jobs",
    project_id: str | None = None,
) -> str:
    project_id = project_id or new_project_key(ctx.settings)[1]
    resolved = JobSpec.model_validate(spec or tiny_spec(steps=3))
    with session_scope(ctx.sessions) as session:
        job = Job(
            id=new_id("job"),
            project_id=project_id,
            spec=resolved.model_dump(mode="json"),
            created_at=utcnow(),
            updated_at=utcnow(),
            total_steps=resolved.grpo.steps,
            max_attempts=2,
            queue=queue,
        )
        transitions.record_created(session, job)
        return job.id


def job(ctx: WorkerContext, job_id: str) -> Job:
    with session_scope(ctx.sessions) as session:
        row = session.get(Job, job_id)
        assert row is not None
        return row


def metric_steps(ctx: WorkerContext, job_id: str) -> list[int]:
    with session_scope(ctx.sessions) as session:
        query = select(JobMetric.step).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
        return list(session.scalars(query))


def event_types(ctx: WorkerContext, job_id: str) -> list[str]:
    with session_scope(ctx.sessions) as session:
        query = select(JobEvent.type).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
        return list(session.scalars(query))


def fake_trainer(
    steps: int = 3,
    between_steps: Callable[[int], None] | None = None,
    calls: list[dict[str, Any]] | None = None,
) -> Train:
    """Trains `steps` steps like the real loop: on_start, then per step should_stop? -> on_step;
    on a stop it saves a checkpoint and returns stopped_early. `between_steps(step)` runs after
    each step (a user cancelling, SIGTERM arriving, a reaper taking the job over)."""

    def train(
        spec: JobSpec,
        callbacks: Callbacks,
        *,
        output_dir: Path,
        resume_from: Path | None,
        device: str,
        sample_groups: int,
    ) -> FakeResult:
        if calls is not None:
            calls.append(
                {
                    "spec": spec,
                    "resume_from": resume_from,
                    "output_dir": output_dir,
                    "sample_groups": sample_groups,
                }
            )
        start = int(resume_from.name.rsplit("-", 1)[1]) if resume_from else 0
        callbacks.on_start(RunInfo(steps, start, Path("/model"), output_dir, device, "fake"))
        for step in range(start + 1, steps + 1):
            if callbacks.should_stop():
                checkpoint = output_dir / f"checkpoint-{step - 1}"
                checkpoint.mkdir(parents=True, exist_ok=True)
                callbacks.on_checkpoint(step - 1, checkpoint)
                return FakeResult(step - 1, stopped_early=True)
            callbacks.on_step(step, {"reward/mean": step / steps, "loss": 0.1})
            if between_steps is not None:
                between_steps(step)
        return FakeResult(steps)

    return train


def test_a_full_run_succeeds_with_one_metrics_row_per_step(ctx: WorkerContext) -> None:
    job_id = make_job(ctx)
    calls: list[dict[str, Any]] = []
    assert run_job(ctx, job_id, train=fake_trainer(3, calls=calls)) == "succeeded"
    final = job(ctx, job_id)
    assert (final.status, final.attempt, final.current_step) == ("succeeded", 1, 3)
    assert final.finished_at is not None
    assert metric_steps(ctx, job_id) == [1, 2, 3]
    assert event_types(ctx, job_id) == ["created", "status", "started", "status"]
    assert calls[0]["resume_from"] is None
    assert calls[0]["output_dir"] == ctx.settings.resolved_checkpoint_dir / job_id
    # The worker's setting decides how many rollout groups per step the trainer reports.
    assert calls[0]["sample_groups"] == ctx.settings.sample_groups_per_step


def test_a_trainer_error_fails_the_job_with_its_reason(ctx: WorkerContext) -> None:
    def step_then_fail(step: int) -> None:
        raise TrainerError("loss is nan 3 steps in a row", reason="non_finite_loss")

    job_id = make_job(ctx)
    assert run_job(ctx, job_id, train=fake_trainer(3, step_then_fail)) == "failed"
    final = job(ctx, job_id)
    assert (final.status, final.error_code) == ("failed", "non_finite_loss")
    assert final.error_message == "loss is nan 3 steps in a row"
    assert metric_steps(ctx, job_id) == [1]


def test_any_other_exception_fails_the_job_with_a_reference_not_a_traceback(
    ctx: WorkerContext, caplog: pytest.LogCaptureFixture
) -> None:
    def crash(step: int) -> None:
        raise RuntimeError("cannot read /srv/grpo/checkpoints/job_other/weights.safetensors")

    job_id = make_job(ctx)
    with caplog.at_level(logging.ERROR, logger="worker.runner"):
        assert run_job(ctx, job_id, train=fake_trainer(3, crash)) == "failed"
    final = job(ctx, job_id)
    assert (final.status, final.error_code) == ("failed", "trainer_error")
    message = final.error_message or ""
    # The user sees no server path, no traceback, no exception text; only where to look.
    assert "/srv" not in message and "Traceback" not in message and "weights" not in message
    assert message.startswith("internal error in the trainer (RuntimeError, reference ")
    assert job_id in message
    reference = message.split("reference ", 1)[1].split(")", 1)[0]
    # The operator's log has the whole story under the same reference and job id.
    logged = [r for r in caplog.records if reference in r.getMessage()]
    assert len(logged) == 1 and job_id in logged[0].getMessage()
    assert logged[0].exc_info is not None
    assert "/srv/grpo/checkpoints" in str(logged[0].exc_info[1])


def test_a_cancel_stops_the_run_at_the_next_step_and_ends_it_cancelled(
    ctx: WorkerContext,
) -> None:
    job_id = make_job(ctx)

    def user_cancels(step: int) -> None:
        if step == 1:  # what POST /v1/jobs/{id}/cancel does, from another connection
            with session_scope(ctx.sessions) as session:
                row = jobs_service.get_job(
                    session, project_id=job(ctx, job_id).project_id, job_id=job_id
                )
                assert jobs_service.cancel_job(session, job=row).status == "cancelling"

    assert run_job(ctx, job_id, train=fake_trainer(3, user_cancels)) == "cancelled"
    final = job(ctx, job_id)
    assert final.status == "cancelled"
    assert metric_steps(ctx, job_id) == [1]
    with session_scope(ctx.sessions) as session:
        saved = session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id))
        assert list(saved) == [1]


def test_shutdown_hands_the_job_back_and_the_next_delivery_resumes_it(
    ctx: WorkerContext,
) -> None:
    job_id = make_job(ctx, queue="gpu-jobs")

    def sigterm(step: int) -> None:
        if step == 2:
            ctx.shutdown.set()

    assert run_job(ctx, job_id, train=fake_trainer(4, sigterm)) == "released"
    handed_back = job(ctx, job_id)
    assert (handed_back.status, handed_back.lease_owner) == ("queued", None)
    assert handed_back.max_attempts == 3  # a hand-over does not spend an attempt
    # re-sent to the job's own queue, after the hand-over was committed
    assert ctx.dispatcher.sent == [job_id]  # type: ignore[attr-defined]
    assert ctx.dispatcher.queues[job_id] == "gpu-jobs"  # type: ignore[attr-defined]
    assert handed_back.dispatched_at is not None

    ctx.shutdown.clear()
    calls: list[dict[str, Any]] = []
    assert run_job(ctx, job_id, train=fake_trainer(4, calls=calls)) == "succeeded"
    assert calls[0]["resume_from"].name == "checkpoint-2"
    final = job(ctx, job_id)
    assert (final.status, final.attempt) == ("succeeded", 2)
    assert metric_steps(ctx, job_id) == [1, 2, 3, 4]


def _control(ctx: WorkerContext, job_id: str, action: str) -> str:
    """What POST /v1/jobs/{id}/pause or /resume does, from another connection."""
    with session_scope(ctx.sessions) as session:
        row = jobs_service.get_job(session, project_id=job(ctx, job_id).project_id, job_id=job_id)
        if action == "pause":
            return pausing.pause_job(session, job=row).status
        resumed = pausing.resume_job(
            session, job=row, dispatcher=ctx.dispatcher, settings=ctx.settings
        )
        return resumed.status


def test_a_pause_checkpoints_frees_the_worker_and_a_resume_continues_from_there(
    ctx: WorkerContext,
) -> None:
    job_id = make_job(ctx)

    def user_pauses(step: int) -> None:
        if step == 2:
            assert _control(ctx, job_id, "pause") == "pausing"

    assert run_job(ctx, job_id, train=fake_trainer(4, user_pauses)) == "paused"
    paused = job(ctx, job_id)
    assert (paused.status, paused.lease_owner, paused.attempt) == ("paused", None, 1)
    assert paused.max_attempts == 3  # a pause does not spend an attempt
    assert metric_steps(ctx, job_id) == [1, 2]
    with session_scope(ctx.sessions) as session:
        saved = session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id))
        assert list(saved) == [2]
    assert ctx.dispatcher.sent == []  # type: ignore[attr-defined]
    # Paused, it is never claimed: a stray delivery of its old message does nothing.
    assert run_job(ctx, job_id, train=fake_trainer(4)) == "not_claimed"

    assert _control(ctx, job_id, "resume") == "queued"
    assert ctx.dispatcher.sent == [job_id]  # type: ignore[attr-defined]
    calls: list[dict[str, Any]] = []
    assert run_job(ctx, job_id, train=fake_trainer(4, calls=calls)) == "succeeded"
    assert calls[0]["resume_from"].name == "checkpoint-2"
    final = job(ctx, job_id)
    assert (final.status, final.attempt) == ("succeeded", 2)
    assert metric_steps(ctx, job_id) == [1, 2, 3, 4]


def test_a_pause_taken_back_before_the_next_step_lets_the_run_finish(
    ctx: WorkerContext,
) -> None:
    job_id = make_job(ctx)

    def pause_then_resume(step: int) -> None:
        if step == 1:
            assert _control(ctx, job_id, "pause") == "pausing"
            assert _control(ctx, job_id, "resume") == "running"

    assert run_job(ctx, job_id, train=fake_trainer(3, pause_then_resume)) == "succeeded"
    assert metric_steps(ctx, job_id) == [1, 2, 3]


def test_a_cancel_during_a_pause_wins(ctx: WorkerContext) -> None:
    job_id = make_job(ctx)

    def pause_then_cancel(step: int) -> None:
        if step == 1:
            assert _control(ctx, job_id, "pause") == "pausing"
            with session_scope(ctx.sessions) as session:
                row = jobs_service.get_job(
                    session, project_id=job(ctx, job_id).project_id, job_id=job_id
                )
                assert jobs_service.cancel_job(session, job=row).status == "cancelling"

    assert run_job(ctx, job_id, train=fake_trainer(3, pause_then_cancel)) == "cancelled"
    assert job(ctx, job_id).status == "cancelled"


def _take_over(ctx: WorkerContext, job_id: str) -> None:
    """What the reaper and a second worker do to a worker that stopped heartbeating."""
    with session_scope(ctx.sessions) as session:
        transitions.transition(session, job_id, JobStatus.QUEUED, attempt=1)
    with session_scope(ctx.sessions) as session:
        assert transitions.claim(session, job_id, "other-worker") == 2


def test_a_worker_that_lost_its_lease_writes_nothing_more(ctx: WorkerContext) -> None:
    job_id = make_job(ctx)

    def taken_over(step: int) -> None:
        if step == 1:
            _take_over(ctx, job_id)

    # The next write (step 2's metrics) raises LeaseLost inside the trainer.
    assert run_job(ctx, job_id, train=fake_trainer(3, taken_over)) == "lease_lost"
    now = job(ctx, job_id)
    assert (now.status, now.attempt, now.lease_owner) == ("running", 2, "other-worker")
    assert metric_steps(ctx, job_id) == [1]
    assert ctx.dispatcher.sent == []  # type: ignore[attr-defined]


def test_a_lost_lease_seen_between_steps_ends_quietly_too(ctx: WorkerContext) -> None:
    job_id = make_job(ctx)

    def train(spec: JobSpec, callbacks: Callbacks, **_: object) -> FakeResult:
        callbacks.on_step(1, {"loss": 0.1})
        _take_over(ctx, job_id)
        assert callbacks.should_stop()  # the trainer asks before step 2
        with pytest.raises(LeaseLost):
            callbacks.on_checkpoint(1, Path("/nowhere"))
        return FakeResult(1, stopped_early=True)

    assert run_job(ctx, job_id, train=train) == "lease_lost"
    assert job(ctx, job_id).status == "running"
    assert "checkpoint" not in event_types(ctx, job_id)


def test_a_second_delivery_of_a_claimed_job_is_not_claimed(ctx: WorkerContext) -> None:
    job_id = make_job(ctx)

    def second_delivery(step: int) -> None:
        if step == 1:  # the broker delivers the same message to another worker
            assert run_job(ctx, job_id, train=never_called) == "not_claimed"

    def never_called(spec: JobSpec, callbacks: Callbacks, **_: object) -> FakeResult:
        raise AssertionError("a job that is not claimed must not train")

    assert run_job(ctx, job_id, train=fake_trainer(2, second_delivery)) == "succeeded"
    assert run_job(ctx, job_id, train=never_called) == "not_claimed"  # finished
    assert job(ctx, job_id).attempt == 1


def test_an_uploaded_dataset_is_resolved_into_rows(ctx: WorkerContext) -> None:
    _, project_id = new_project_key(ctx.settings)
    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4"}]
    file_id = new_id("file")
    with session_scope(ctx.sessions) as session:
        session.add(
            File(
                id=file_id,
                project_id=project_id,
                filename="d.jsonl",
                purpose="train",
                bytes=10,
                row_count=2,
                rows=rows,
            )
        )
    with_file = make_job(
        ctx, tiny_spec(steps=1) | {"dataset": {"file_id": file_id}}, project_id=project_id
    )
    calls: list[dict[str, Any]] = []
    assert run_job(ctx, with_file, train=fake_trainer(1, calls=calls)) == "succeeded"
    dataset = calls[0]["spec"].dataset
    assert dataset.file_id is None
    assert [(r.prompt, r.answer) for r in dataset.rows] == [("1+1?", "2"), ("2+2?", "4")]


def test_a_saved_dataset_under_the_roots_is_resolved_into_rows(
    ctx: WorkerContext, tmp_path: Path
) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "datasets" / "qa"
    datasets.Dataset.from_dict({"q": ["1+1?", "2+2?"], "a": ["2", "4"]}).save_to_disk(str(folder))
    saved = {"path": str(folder), "columns": {"prompt": "q", "answer": "a"}}
    spec = tiny_spec(steps=1) | {"dataset": {"saved_dataset": saved}}
    ctx.settings.dataset_roots = str(tmp_path / "datasets")
    calls: list[dict[str, Any]] = []
    assert run_job(ctx, make_job(ctx, spec), train=fake_trainer(1, calls=calls)) == "succeeded"
    dataset = calls[0]["spec"].dataset
    assert dataset.saved_dataset is None
    assert [(r.prompt, r.answer) for r in dataset.rows] == [("1+1?", "2"), ("2+2?", "4")]
    # The worker applies the rule itself: with other roots, the job fails before training.
    ctx.settings.dataset_roots = str(tmp_path / "elsewhere")
    refused = make_job(ctx, spec)
    assert run_job(ctx, refused, train=fake_trainer(1)) == "failed"
    assert job(ctx, refused).error_code == "dataset_not_allowed"
    assert str(folder) not in (job(ctx, refused).error_message or "")


def test_a_dataset_file_deleted_after_submission_fails_the_job(ctx: WorkerContext) -> None:
    missing = make_job(ctx, tiny_spec(steps=1) | {"dataset": {"file_id": "file_gone"}})
    assert run_job(ctx, missing, train=fake_trainer(1)) == "failed"
    assert job(ctx, missing).error_code == "file_missing"


def test_a_model_outside_the_model_roots_fails_the_job_before_training(
    ctx: WorkerContext, tmp_path: Path
) -> None:
    # Another project's checkpoint folder: a real model folder, outside the operator's roots.
    theirs = ctx.settings.resolved_checkpoint_dir / "job_theirs" / "checkpoint-2"
    theirs.mkdir(parents=True)
    (theirs / "config.json").write_text("{}")
    roots = tmp_path / "models"
    roots.mkdir()
    confined = WorkerContext(
        ctx.settings.model_copy(update={"model_roots": str(roots)}), ctx.sessions, ctx.dispatcher
    )

    def never_called(spec: JobSpec, callbacks: Callbacks, **_: object) -> FakeResult:
        raise AssertionError("a model outside the roots must not be loaded")

    outcomes: dict[str, str] = {}
    for model in (str(theirs), str(roots / "missing"), f"{roots}/../{theirs.name}"):
        job_id = make_job(ctx, tiny_spec(steps=1) | {"model": model})
        assert run_job(confined, job_id, train=never_called) == "failed"
        final = job(ctx, job_id)
        assert final.error_code == "model_not_allowed"
        outcomes[model] = final.error_message or ""
    # One message for an existing folder and a missing one, naming no path.
    assert len(set(outcomes.values())) == 1
    assert "/" not in next(iter(outcomes.values()))


def test_a_model_under_a_root_is_trained_from_its_real_path(
    ctx: WorkerContext, tmp_path: Path
) -> None:
    folder = tmp_path / "models" / "team" / "llama"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    link = tmp_path / "models" / "latest"
    link.symlink_to(folder)
    confined = WorkerContext(
        ctx.settings.model_copy(update={"model_roots": f"/nonexistent:{tmp_path / 'models'}"}),
        ctx.sessions,
        ctx.dispatcher,
    )
    calls: list[dict[str, Any]] = []
    job_id = make_job(ctx, tiny_spec(steps=1) | {"model": str(link)})
    assert run_job(confined, job_id, train=fake_trainer(1, calls=calls)) == "succeeded"
    # The trainer opens exactly the folder that was checked, not the symlink.
    assert calls[0]["spec"].model == str(folder.resolve())


def _checkpoint_of(ctx: WorkerContext, job_id: str, step: int, folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    with session_scope(ctx.sessions) as session:
        session.add(
            Checkpoint(job_id=job_id, step=step, attempt=1, path=str(folder), created_at=utcnow())
        )


def test_init_from_starts_from_the_named_checkpoint_of_the_same_project(
    ctx: WorkerContext, tmp_path: Path
) -> None:
    project = new_project_key(ctx.settings)[1]
    earlier = make_job(ctx, project_id=project)
    folder = ctx.settings.resolved_checkpoint_dir / earlier / "checkpoint-000002"
    _checkpoint_of(ctx, earlier, 2, folder)
    spec = {**tiny_spec(steps=3), "init_from": {"job_id": earlier, "step": 2}}
    later = make_job(ctx, spec, project_id=project)
    calls: list[dict[str, Any]] = []
    assert run_job(ctx, later, train=fake_trainer(3, calls=calls)) == "succeeded"
    # The trainer opens the checkpoint folder, looked up by job and step, not a user's path.
    assert calls[0]["spec"].model == str(folder)


def test_init_from_another_projects_job_fails_without_loading_it(ctx: WorkerContext) -> None:
    other = make_job(ctx)  # a project of its own
    _checkpoint_of(ctx, other, 1, ctx.settings.resolved_checkpoint_dir / other / "checkpoint-1")
    spec = {**tiny_spec(steps=3), "init_from": {"job_id": other, "step": 1}}
    mine = make_job(ctx, spec)
    calls: list[dict[str, Any]] = []
    assert run_job(ctx, mine, train=fake_trainer(3, calls=calls)) == "failed"
    assert calls == []
    final = job(ctx, mine)
    assert final.error_code == "init_checkpoint_missing"
    assert str(ctx.settings.resolved_checkpoint_dir) not in (final.error_message or "")
