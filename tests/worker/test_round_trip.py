"""A job created over HTTP is picked up by a real Celery worker process through the real broker
(Redis, or the embedded filesystem queue) and trains to a terminal state."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from tests.conftest import Api, tiny_spec
from tests.worker.conftest import WorkerProcess, wait_for


def test_job_runs_through_a_real_worker(
    api: Api, start_worker: Callable[..., WorkerProcess]
) -> None:
    # A queue of its own: API tests leave unconsumed messages on the session's queue.
    api.settings.queue_name = f"{api.settings.queue_name}-{secrets.token_hex(3)}"
    worker = start_worker(api.settings)
    job = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers).json()

    def finished() -> dict[str, object] | None:
        body = api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers).json()
        return body if body["status"] in ("succeeded", "failed", "cancelled") else None

    try:
        final = wait_for(finished, 240, "the job to finish")
    except AssertionError:
        raise AssertionError(worker.log_tail()) from None
    assert isinstance(final, dict)
    assert final["status"] == "succeeded", (final["error"], worker.log_tail())
    assert final["attempt"] == 1
    assert final["progress"]["step"] == 2
    events = api.client.get(f"/v1/jobs/{job['id']}/events", headers=api.headers).json()["data"]
    transitions = [(e["data"] or {}).get("to") for e in events if e["type"] == "status"]
    assert transitions == ["running", "succeeded"]
    kinds = [e["type"] for e in events]
    assert "started" in kinds and "checkpoint" in kinds


def test_lora_and_bfloat16_jobs_train_through_a_real_worker(
    api: Api, start_worker: Callable[..., WorkerProcess]
) -> None:
    """The two training modes a user picks in the spec, end to end: submitted over HTTP,
    trained by a Celery worker, checkpointed (a LoRA job's checkpoint holds adapters only)."""
    from pathlib import Path

    api.settings.queue_name = f"{api.settings.queue_name}-{secrets.token_hex(3)}"
    worker = start_worker(api.settings)
    specs = {
        "lora": tiny_spec() | {"lora": {"rank": 4}},
        "bf16": tiny_spec(dtype="bfloat16"),
    }
    ids = {}
    for kind, spec in specs.items():
        response = api.client.post("/v1/jobs", json=spec, headers=api.headers)
        assert response.status_code == 201, response.text
        ids[kind] = response.json()["id"]

    def both_finished() -> dict[str, dict[str, object]] | None:
        bodies = {
            kind: api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json()
            for kind, job_id in ids.items()
        }
        ended = all(b["status"] in ("succeeded", "failed", "cancelled") for b in bodies.values())
        return bodies if ended else None

    try:
        final = wait_for(both_finished, 400, "both jobs to finish")
    except AssertionError:
        raise AssertionError(worker.log_tail()) from None
    assert isinstance(final, dict)
    for kind, body in final.items():
        assert body["status"] == "succeeded", (kind, body["error"], worker.log_tail())
        assert body["spec"]["lora" if kind == "lora" else "grpo"] is not None
    assert final["bf16"]["spec"]["grpo"]["dtype"] == "bfloat16"
    saved = api.client.get(f"/v1/jobs/{ids['lora']}/checkpoints", headers=api.headers).json()
    folder = Path(api.settings.resolved_checkpoint_dir) / ids["lora"]
    checkpoint = folder / f"checkpoint-{saved['data'][-1]['step']:06d}"
    names = {p.name for p in checkpoint.iterdir()}
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names
