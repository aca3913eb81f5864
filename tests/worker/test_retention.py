"""Checkpoint retention in the service: the worker (worker.runner.run_job with the real database
callbacks) records each checkpoint with its size and ranking value and deletes what the job's
`checkpoint` section does not keep, so the disk, GET /v1/jobs/{id}/checkpoints, the download
route and GET /v1/usage agree. The trainer is a stand-in driving the callbacks the way
trainer.run.loop does, writing real checkpoints of the tiny model with trainer.checkpoint.store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from app.core.db import make_engine, make_session_factory, session_scope
from app.jobs import transitions
from jobspec import JobSpec
from tests.conftest import Api, RecordingDispatcher, tiny_spec
from trainer.checkpoint.store import list_checkpoints, save_checkpoint
from trainer.models.loading import load_policy, resolve_model
from trainer.run.callbacks import Callbacks, RunInfo
from worker.context import WorkerContext
from worker.lease import LeaseKeeper
from worker.progress import DatabaseCallbacks
from worker.runner import Train, latest_checkpoint, run_job
from worker.settings import build_worker_settings

ACCURACY = {3: 0.2, 6: 0.7, 9: 0.4, 12: 0.5}  # evaluated every 3 steps


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any, torch.optim.Optimizer]:
    model, tokenizer = load_policy(resolve_model("tiny-random-llama"))
    return model, tokenizer, torch.optim.AdamW(model.parameters(), lr=1e-3)


def worker_ctx(api: Api, **overrides: object) -> WorkerContext:
    ws = build_worker_settings(
        data_dir=api.settings.data_dir,
        database_url=api.settings.resolved_database_url,
        broker_url=api.settings.resolved_broker_url,
        worker_name="retention-test",
        db_retry_seconds=1,
        **overrides,
    )
    return WorkerContext(
        ws, make_session_factory(make_engine(ws.resolved_database_url)), RecordingDispatcher()
    )


def checkpointing_trainer(tiny: tuple[Any, Any, torch.optim.Optimizer]) -> Train:
    """Trains like trainer.run.loop: per step on_step (eval/accuracy every 3 steps), then a real
    checkpoint (every `checkpoint_interval` steps) and on_checkpoint; deletes nothing itself
    when the callbacks apply the retention, as the loop does."""
    model, tokenizer, optimizer = tiny

    def train(
        spec: JobSpec,
        callbacks: Callbacks,
        /,
        *,
        output_dir: Path,
        resume_from: Path | None,
        device: str,
        sample_groups: int,
    ) -> Any:
        steps = spec.grpo.steps
        callbacks.on_start(RunInfo(steps, 0, None, output_dir, device, "fake"))
        for step in range(1, steps + 1):
            metrics = {"reward/mean": 0.5} | (
                {"eval/accuracy": ACCURACY[step]} if step in ACCURACY else {}
            )
            callbacks.on_step(step, metrics)
            if step % spec.checkpoint_interval == 0:
                path = save_checkpoint(
                    output_dir,
                    step,
                    model=model,
                    tokenizer=tokenizer,
                    optimizer=optimizer,
                    scheduler=None,
                    sampler={"index": step},
                    retention=None if callbacks.applies_retention else spec.checkpoint,
                )
                callbacks.on_checkpoint(step, path)

        class Result:
            final_step = steps
            stopped_early = False

        return Result()

    return train


def on_disk(folder: Path) -> dict[int, int]:
    """step -> bytes of every complete checkpoint in `folder`, measured here by walking it."""
    return {
        step: sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        for step, path in list_checkpoints(folder)
    }


def test_a_12_checkpoint_job_keeps_the_last_2_and_the_best(
    api: Api, tiny: tuple[Any, Any, torch.optim.Optimizer]
) -> None:
    spec = tiny_spec(steps=12) | {
        "checkpoint_interval": 1,
        "checkpoint": {"keep_last": 2, "keep_best_by": "eval/accuracy"},
    }
    created = api.client.post("/v1/jobs", json=spec, headers=api.headers)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    ctx = worker_ctx(api)
    assert run_job(ctx, job_id, train=checkpointing_trainer(tiny)) == "succeeded"

    folder = ctx.settings.resolved_checkpoint_dir / job_id
    sizes = on_disk(folder)
    # The newest two, and step 6: the first with the best accuracy (0.7; steps 7 and 8 carried
    # that value until the next evaluation, and went as newer checkpoints came).
    assert sorted(sizes) == [6, 11, 12]
    assert sorted(p.name for p in folder.iterdir()) == [
        "checkpoint-000006",
        "checkpoint-000011",
        "checkpoint-000012",
    ]  # nothing half-deleted, no trash left
    listed = api.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=api.headers).json()["data"]
    assert [(c["step"], c["size_bytes"]) for c in listed] == sorted(sizes.items())
    url = f"/v1/jobs/{job_id}/checkpoints/{{}}/download"
    for step in (1, 5, 7, 8, 10):
        response = api.client.get(url.format(step), headers=api.headers)
        assert response.status_code == 410, (step, response.text)
        assert response.json()["error"]["type"] == "gone"
    assert api.client.get(url.format(6), headers=api.headers).status_code == 200
    assert api.client.get(url.format(13), headers=api.headers).status_code == 404
    # A resume starts from the newest.
    assert latest_checkpoint(ctx, job_id) == folder / "checkpoint-000012"
    # The events say what went.
    events = api.client.get(f"/v1/jobs/{job_id}/events?limit=1000", headers=api.headers).json()
    deleted = [
        s
        for e in events["data"]
        if e["type"] == "checkpoint"
        for s in e["data"].get("deleted_steps", [])
    ]
    assert sorted(deleted) == [1, 2, 3, 4, 5, 7, 8, 9, 10]
    # Usage: the recorded sizes, which are the bytes on disk.
    usage = api.client.get("/v1/usage", headers=api.headers).json()
    assert usage["checkpoint_bytes"] == sum(sizes.values()) > 0
    assert usage["checkpoints"] == 3 and usage["jobs_with_checkpoints"] == 1
    assert usage["jobs"] == [
        {"job_id": job_id, "checkpoint_bytes": sum(sizes.values()), "checkpoints": 3}
    ]
    assert usage["has_more"] is False


def test_folders_left_by_a_worker_that_died_after_marking_are_removed_on_the_next_start(
    api: Api, tmp_path: Path
) -> None:
    job_id = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers).json()["id"]
    ctx = worker_ctx(api)
    with session_scope(ctx.sessions) as session:
        attempt = transitions.claim(session, job_id, "retention-test")
    assert attempt == 1
    lease = LeaseKeeper(ctx.sessions, job_id, attempt, interval_s=60)
    retention = JobSpec.model_validate(tiny_spec() | {"checkpoint": {"keep_last": 1}}).checkpoint
    callbacks = DatabaseCallbacks(ctx, job_id, attempt, lease, retention=retention)
    folder = ctx.settings.resolved_checkpoint_dir / job_id

    def write(step: int) -> Path:
        path = folder / f"checkpoint-{step:06d}"
        path.mkdir(parents=True)
        (path / "manifest.json").write_text("{}")
        (path / "model.safetensors").write_bytes(b"w" * 1000 * step)
        return path

    callbacks.on_checkpoint(1, write(1))
    callbacks.on_checkpoint(2, write(2))
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-000002"]
    # A worker that died between the commit and the removal left the folder of step 1.
    write(1)
    # Outside the job's folder nothing is touched, even when a row points there.
    stranger = tmp_path / "checkpoint-000003"
    stranger.mkdir()
    callbacks.on_checkpoint(3, stranger)
    assert stranger.is_dir()
    callbacks.on_checkpoint(4, write(4))
    assert stranger.is_dir() and (folder / "checkpoint-000001").is_dir()
    DatabaseCallbacks(ctx, job_id, attempt, lease, retention=retention).on_start(
        RunInfo(4, 4, None, folder, "cpu", "fake")
    )
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-000004"]
    assert stranger.is_dir()
    listed = api.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=api.headers).json()["data"]
    assert [(c["step"], c["size_bytes"]) for c in listed] == [(4, 4000 + 2)]
