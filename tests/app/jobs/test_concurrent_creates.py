"""Many creates of one project at once: every one is answered, none waits for the pool.

bench/load_create.py found the API stalling at ~40 creates/s: a request keeps its pooled
connection (and the project's row lock) between the thread hops FastAPI runs its dependency,
route and commit in, and with more requests in flight than the pool holds, the threads blocked
on the pool or on that lock starved the holders of a thread to commit in; the idempotency claim
taking a second connection from the same pool closed another cycle. Requests then failed with
503 after the pool's 30 s timeout.
"""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi.testclient import TestClient

from app.core.settings import build_settings
from app.main import create_app
from tests.conftest import REDIS_URL, new_project_key, tiny_spec

CONCURRENT = 80  # twice the threadpool, four times the connection pool


def test_concurrent_idempotent_creates_of_one_project_all_succeed(
    pg_url: str, tmp_path: Path, queue_name: str
) -> None:
    settings = build_settings(
        data_dir=tmp_path,
        database_url=pg_url,
        broker_url=REDIS_URL,
        queue_name=f"{queue_name}-concurrent",
        rate_limit_per_minute=100_000,
        rate_limit_burst=10_000,
        max_active_jobs_per_project=10_000,
        max_active_devices_per_project=10_000,
    )
    key, _ = new_project_key(settings)
    headers = {"Authorization": f"Bearer {key}"}
    run = secrets.token_hex(4)
    app = create_app(settings)
    with TestClient(app) as client:

        def create(i: int) -> int:
            response = client.post(
                "/v1/jobs",
                json=tiny_spec(),
                headers={**headers, "Idempotency-Key": f"{run}-{i}"},
            )
            return response.status_code

        with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
            statuses = list(pool.map(create, range(CONCURRENT)))
        listed = client.get("/v1/jobs?limit=100", headers=headers).json()["data"]
    app.state.grpo.engine.dispose()
    assert statuses == [201] * CONCURRENT, sorted(set(statuses))
    assert len(listed) == CONCURRENT
