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
