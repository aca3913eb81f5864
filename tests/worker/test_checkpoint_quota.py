"""The per-project checkpoint storage quota (GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT), enforced by
the worker as it records each checkpoint (worker.progress, app.usage.service).

Jobs run through worker.runner.run_job with the real database callbacks; the trainer is a
stand-in that writes checkpoint folders of chosen sizes (no model: the quota only reads the
recorded sizes), the way trainer.run.loop saves them, so each test takes a moment."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.jobs import transitions
from app.progress import repository as progress_repo
from app.usage import service as checkpoint_quota
from jobspec import JobSpec
from tests.conftest import Api, RecordingDispatcher, tiny_spec
from trainer.run.callbacks import Callbacks, RunInfo
from worker.context import WorkerContext
from worker.lease import LeaseKeeper
from worker.maintenance import purge_deleted_jobs
from worker.progress import CheckpointQuotaExceeded, DatabaseCallbacks
from worker.runner import Train, latest_checkpoint, run_job
from worker.settings import build_worker_settings

LIMIT = 10_000
SETTING = "GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT"


def worker_ctx(api: Api, **overrides: object) -> WorkerContext:
    ws = build_worker_settings(
        data_dir=api.settings.data_dir,
        database_url=api.settings.resolved_database_url,
        broker_url=api.settings.resolved_broker_url,
        worker_name="quota-test",
        db_retry_seconds=1,
        **({"max_checkpoint_bytes_per_project": LIMIT} | overrides),
    )
    return WorkerContext(
        ws, make_session_factory(make_engine(ws.resolved_database_url)), RecordingDispatcher()
    )


def sized_trainer(sizes: dict[int, int]) -> Train:
    """Per step on_step, then (at each step in `sizes`) a checkpoint folder of that many bytes
    and on_checkpoint, as trainer.run.loop saves: an error raised by the callbacks ends the run."""

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
            callbacks.on_step(step, {"reward/mean": 0.5})
            if step in sizes:
                path = output_dir / f"checkpoint-{step:06d}"
                path.mkdir(parents=True)
                (path / "model.safetensors").write_bytes(b"w" * sizes[step])
                callbacks.on_checkpoint(step, path)

        class Result:
            final_step = steps
            stopped_early = False

        return Result()

    return train


def submit(
    api: Api, steps: int, keep_last: int | None = 3, headers: dict[str, str] | None = None
) -> str:
    spec = tiny_spec(steps=steps) | {
        "checkpoint_interval": 1,
        "checkpoint": {"keep_last": keep_last},
    }
    created = api.client.post("/v1/jobs", json=spec, headers=headers or api.headers)
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def kept(api: Api, job_id: str, headers: dict[str, str] | None = None) -> list[tuple[int, int]]:
    listed = api.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=headers or api.headers)
    return [(c["step"], c["size_bytes"]) for c in listed.json()["data"]]


def on_disk(ctx: WorkerContext, job_id: str) -> list[str]:
    folder = ctx.settings.resolved_checkpoint_dir / job_id
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_a_checkpoint_that_would_exceed_the_quota_is_not_kept_and_fails_the_job(
    api: Api,
) -> None:
    ctx = worker_ctx(api)
    first = submit(api, steps=1)
    assert run_job(ctx, first, train=sized_trainer({1: 3000})) == "succeeded"

    # keep_last 2: at step 3 the job's retention drops step 1 before the count (3000 + 6000
    # stored; 12,000 if it were counted first); step 4's 5000 bytes would make 11,000.
    job_id = submit(api, steps=5, keep_last=2)
    sizes = {1: 3000, 2: 3000, 3: 3000, 4: 5000, 5: 10}
    assert run_job(ctx, job_id, train=sized_trainer(sizes)) == "failed"

    job = api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json()
    assert job["status"] == "failed"
    assert job["error"]["code"] == "checkpoint_quota_exceeded"
    message = job["error"]["message"]
    assert SETTING in message and "checkpoint of step 4" in message
    assert "latest kept checkpoint is step 3" in message
    # The refused checkpoint is gone; what the retention would have dropped with it stays
    # (the rolled-back save marked nothing), so the job can be continued from step 3.
    assert kept(api, job_id) == [(2, 3000), (3, 3000)]
    assert on_disk(ctx, job_id) == ["checkpoint-000002", "checkpoint-000003"]
    assert latest_checkpoint(ctx, job_id) == (
        ctx.settings.resolved_checkpoint_dir / job_id / "checkpoint-000003"
    )

    events = api.client.get(f"/v1/jobs/{job_id}/events?limit=1000", headers=api.headers).json()
    refused = [e for e in events["data"] if e["type"] == "checkpoint_quota_exceeded"]
    assert len(refused) == 1 and refused[0]["level"] == "error"
    assert refused[0]["message"] == message
    assert refused[0]["data"] == {
        "step": 4,
        "bytes": 5000,
        "setting": SETTING,
        "limit_bytes": LIMIT,
        "used_bytes": 9000,
        "used_bytes_with_checkpoint": 11_000,
        "pending_purge_bytes": 0,
        "last_kept_step": 3,
    }
    saved = [e["data"]["step"] for e in events["data"] if e["type"] == "checkpoint"]
    assert saved == [1, 2, 3]  # step 4's checkpoint event was rolled back with its row

    usage = api.client.get("/v1/usage", headers=api.headers).json()
    assert usage["checkpoint_bytes"] == 9000


def test_another_projects_checkpoints_do_not_count(api: Api) -> None:
    ctx = worker_ctx(api)
    other_key, _ = api.new_key()
    other = {"Authorization": f"Bearer {other_key}"}
    full = submit(api, steps=1, headers=other)
    assert run_job(ctx, full, train=sized_trainer({1: LIMIT})) == "succeeded"  # at the limit

    job_id = submit(api, steps=2)
    assert run_job(ctx, job_id, train=sized_trainer({1: 4000, 2: 4000})) == "succeeded"
    assert kept(api, job_id) == [(1, 4000), (2, 4000)]
    assert kept(api, full, headers=other) == [(1, LIMIT)]
    # The other project, at its limit, can store no more.
    more = submit(api, steps=1, headers=other)
    assert run_job(ctx, more, train=sized_trainer({1: 1})) == "failed"


def test_deleted_jobs_count_until_purged_and_zero_means_no_limit(api: Api) -> None:
    ctx = worker_ctx(api)
    old = submit(api, steps=1)
    assert run_job(ctx, old, train=sized_trainer({1: 8000})) == "succeeded"
    assert api.client.delete(f"/v1/jobs/{old}", headers=api.headers).status_code == 200

    # Its folder is still on disk until the purge: it still counts.
    job_id = submit(api, steps=1)
    assert run_job(ctx, job_id, train=sized_trainer({1: 4000})) == "failed"
    events = api.client.get(f"/v1/jobs/{job_id}/events?limit=1000", headers=api.headers).json()
    (refused,) = [e for e in events["data"] if e["type"] == "checkpoint_quota_exceeded"]
    assert refused["data"]["pending_purge_bytes"] == 8000
    assert "no kept checkpoint" in refused["message"] and kept(api, job_id) == []

    assert old in purge_deleted_jobs(worker_ctx(api, delete_grace_seconds=0))
    again = submit(api, steps=1)
    assert run_job(ctx, again, train=sized_trainer({1: 4000})) == "succeeded"

    # 0: no limit.
    unlimited = worker_ctx(api, max_checkpoint_bytes_per_project=0)
    big = submit(api, steps=1)
    assert run_job(unlimited, big, train=sized_trainer({1: 3 * LIMIT})) == "succeeded"
    assert kept(api, big) == [(1, 3 * LIMIT)]


def test_two_jobs_of_a_project_saving_at_once_are_counted_one_after_the_other(api: Api) -> None:
    """A save holds the project's storage lock from its count to its commit: a second job's save
    waits for it, then counts the first one's checkpoint (without the lock both would pass,
    each seeing 6000 of 10,000 bytes)."""
    ctx = worker_ctx(api)
    first, second = submit(api, steps=1), submit(api, steps=1)
    with session_scope(ctx.sessions) as session:
        attempt = transitions.claim(session, second, "quota-test")
    assert attempt == 1
    lease = LeaseKeeper(ctx.sessions, second, attempt, interval_s=60)
    callbacks = DatabaseCallbacks(ctx, second, attempt, lease)
    path = ctx.settings.resolved_checkpoint_dir / second / "checkpoint-000001"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"w" * 6000)

    outcome: list[BaseException | None] = []

    def save() -> None:
        try:
            callbacks.on_checkpoint(1, path)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    saver = threading.Thread(target=save)
    with session_scope(ctx.sessions) as session:  # the first job's save, still uncommitted
        progress_repo.add_checkpoint_once(
            session,
            job_id=first,
            step=1,
            attempt=1,
            path=ctx.settings.resolved_checkpoint_dir / first / "checkpoint-000001",
            now=utcnow(),
            size_bytes=6000,
        )
        assert (
            checkpoint_quota.check_recorded(session, project_id=api.project_id, limit=LIMIT) is None
        )
        saver.start()
        time.sleep(1.0)
        assert saver.is_alive() and not outcome  # waiting for this transaction
    saver.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], CheckpointQuotaExceeded)
    assert "would take 11.72 KiB" in str(outcome[0]) and not path.exists()
