"""DELETE /v1/jobs/{id}: only an ended job; hidden at once; purged (checkpoint folders, samples,
metrics, rollups, events, checkpoint rows) by the workers' maintenance pass after the grace
period. And GET /v1/usage, which counts the bytes of the project's kept checkpoints."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import func, select

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.models import Checkpoint, Job, JobEvent, JobMetric, JobMetricRollup, JobSample
from tests.app.progress.test_progress_api import finish, running_job
from tests.conftest import Api, RecordingDispatcher, tiny_spec
from trainer.run.callbacks import CompletionSample, RolloutSample
from worker.context import WorkerContext
from worker.maintenance import purge_deleted_jobs
from worker.progress import DatabaseCallbacks
from worker.settings import build_worker_settings

PRODUCED = (JobSample, JobMetric, JobMetricRollup, JobEvent, Checkpoint)


def maintenance(api: Api, grace_s: float) -> WorkerContext:
    ws = build_worker_settings(
        data_dir=api.settings.data_dir,
        database_url=api.settings.resolved_database_url,
        broker_url=api.settings.resolved_broker_url,
        delete_grace_seconds=grace_s,
    )
    return WorkerContext(
        ws, make_session_factory(make_engine(ws.resolved_database_url)), RecordingDispatcher()
    )


def produce(api: Api, job_id: str, callbacks: DatabaseCallbacks, steps: int) -> Path:
    """Metrics, samples and a checkpoint folder of `steps` bytes-ish per step; the job folder."""
    folder = api.settings.resolved_checkpoint_dir / job_id
    sample = RolloutSample("1+1=", "2", [CompletionSample("2", 1.0, {"n": 1.0}, 0.5, 1, "stop")])
    for step in range(1, steps + 1):
        callbacks.on_step(step, {"reward/mean": step / steps})
        callbacks.on_samples(step, [sample])
        path = folder / f"checkpoint-{step:06d}"
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
        (path / "model.safetensors").write_bytes(b"w" * 100 * step)
        callbacks.on_checkpoint(step, path)
    return folder


def rows_of(api: Api, job_id: str) -> dict[str, int]:
    engine = make_engine(api.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            return {
                model.__tablename__: int(
                    session.scalar(
                        select(func.count()).select_from(model).where(model.job_id == job_id)
                    )
                    or 0
                )
                for model in PRODUCED
            }
    finally:
        engine.dispose()


def delete(api: Api, job_id: str, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return api.client.delete(f"/v1/jobs/{job_id}", headers=headers or api.headers)


def test_a_job_that_has_not_ended_cannot_be_deleted(api: Api) -> None:
    queued = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers).json()["id"]
    job_id, _, _ = running_job(api)
    for still_on in (queued, job_id):
        response = delete(api, still_on)
        assert response.status_code == 409, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_state" and error["param"] == "job_id"
        assert "cancel" in error["message"]
        assert api.client.get(f"/v1/jobs/{still_on}", headers=api.headers).status_code == 200
    other_key, _ = api.new_key()
    assert delete(api, job_id, {"Authorization": f"Bearer {other_key}"}).status_code == 404


def test_an_ended_job_is_hidden_at_once_and_purged_after_the_grace(api: Api) -> None:
    job_id, callbacks, ctx = running_job(api)
    folder = produce(api, job_id, callbacks, steps=3)
    kept_id, kept_callbacks, kept_ctx = running_job(api)
    kept_folder = produce(api, kept_id, kept_callbacks, steps=2)
    finish(ctx, job_id)
    finish(kept_ctx, kept_id)

    usage = api.client.get("/v1/usage", headers=api.headers).json()
    on_disk = {
        j: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        for j, d in ((job_id, folder), (kept_id, kept_folder))
    }
    assert usage["checkpoint_bytes"] == sum(on_disk.values())
    assert usage["checkpoints"] == 5 and usage["jobs_with_checkpoints"] == 2
    # Largest first.
    assert [(j["job_id"], j["checkpoint_bytes"]) for j in usage["jobs"]] == [
        (job_id, on_disk[job_id]),
        (kept_id, on_disk[kept_id]),
    ]
    page = api.client.get("/v1/usage?limit=1", headers=api.headers).json()
    assert len(page["jobs"]) == 1 and page["has_more"] is True
    assert api.client.get("/v1/usage?limit=101", headers=api.headers).status_code == 422

    response = delete(api, job_id)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"] == job_id and body["deleted"] is True and body["purge_after"]
    # Gone from every read of the project; a second delete finds nothing.
    for path in ("", "/events", "/metrics", "/checkpoints", "/checkpoints/1/download"):
        got = api.client.get(f"/v1/jobs/{job_id}{path}", headers=api.headers)
        assert got.status_code == 404, (path, got.text)
        assert got.json()["error"]["param"] == "job_id"
    listed = api.client.get("/v1/jobs?limit=100", headers=api.headers).json()["data"]
    assert job_id not in [j["id"] for j in listed] and kept_id in [j["id"] for j in listed]
    assert delete(api, job_id).status_code == 404
    # A new job cannot start from its checkpoints any more.
    init = tiny_spec() | {"init_from": {"job_id": job_id, "step": 3}}
    refused = api.client.post("/v1/jobs", json=init, headers=api.headers)
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "init_from.job_id"
    usage = api.client.get("/v1/usage", headers=api.headers).json()
    assert usage["checkpoint_bytes"] == on_disk[kept_id] and usage["jobs_with_checkpoints"] == 1

    # Within the grace period nothing is purged.
    assert job_id not in purge_deleted_jobs(maintenance(api, grace_s=3600))
    assert folder.is_dir() and rows_of(api, job_id)["job_metrics"] == 3
    # After it: the folder, then the rows; the job that was not deleted keeps everything.
    assert job_id in purge_deleted_jobs(maintenance(api, grace_s=0))
    assert not folder.exists()
    assert not list(folder.parent.glob(f".trash-{job_id}-*"))
    assert rows_of(api, job_id) == dict.fromkeys(rows_of(api, kept_id), 0)
    assert all(n > 0 for n in rows_of(api, kept_id).values())
    assert kept_folder.is_dir()
    engine = make_engine(api.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            job = session.get(Job, job_id)
            assert job is not None and job.status == "succeeded"
            assert job.deleted_at is not None and job.purged_at is not None
    finally:
        engine.dispose()
    # Purged once: the next pass has nothing to do for it.
    assert job_id not in purge_deleted_jobs(maintenance(api, grace_s=0))
