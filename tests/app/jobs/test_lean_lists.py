"""GET /v1/jobs lists summaries without inline dataset rows, and large inline rows are stored as
a file of the project when a job is created (the worker still trains on the same rows)."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.ids import new_id
from app.core.models import Job
from app.datasets.service import SPILL_INLINE_ROWS_BYTES
from app.jobs import repository as jobs_repo
from app.main import create_app
from jobspec import JobSpec
from tests.conftest import Api, new_project_key, settings_for, tiny_spec
from worker.context import WorkerContext
from worker.runner import load_spec
from worker.settings import build_worker_settings


def inline_rows(count: int, chars: int = 200, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [
        {"prompt": "".join(rng.choices(string.ascii_letters, k=chars)), "answer": str(i)}
        for i in range(count)
    ]


def spec_with_rows(rows: list[dict[str, str]]) -> dict[str, object]:
    return tiny_spec() | {"dataset": {"rows": rows}}


def test_a_list_of_100_jobs_with_large_inline_datasets_is_under_1_mb(api: Api) -> None:
    # Stored as jobs created before inline rows were moved to files: each spec keeps 2,000
    # rows of 200 characters (~450 KB), 45 MB for the page.
    spec = JobSpec.model_validate(spec_with_rows(inline_rows(2_000))).model_dump(mode="json")
    engine = make_engine(api.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            for _ in range(100):
                now = utcnow()
                job = Job(
                    id=new_id("job"),
                    project_id=api.project_id,
                    name="big",
                    status="queued",
                    spec=spec,
                    attempt=0,
                    max_attempts=3,
                    queue="q",
                    created_at=now,
                    updated_at=now,
                    total_steps=2,
                )
                jobs_repo.add(session, job=job)
    finally:
        engine.dispose()
    assert len(json.dumps(spec)) * 100 > 40_000_000
    response = api.client.get("/v1/jobs", params={"limit": 100}, headers=api.headers)
    assert response.status_code == 200
    assert len(response.content) < 1_000_000
    jobs = response.json()["data"]
    assert len(jobs) == 100
    for listed in jobs:
        dataset = listed["spec"]["dataset"]
        assert "rows" not in dataset and dataset["row_count"] == 2_000
        assert listed["spec"]["grpo"] == spec["grpo"]  # what the dashboard shows (KL) is there
    # One job in full: every row.
    full = api.client.get(f"/v1/jobs/{jobs[0]['id']}", headers=api.headers).json()
    assert full["spec"] == spec


def test_small_inline_rows_stay_inline(api: Api) -> None:
    rows = inline_rows(20)
    created = api.client.post("/v1/jobs", json=spec_with_rows(rows), headers=api.headers)
    assert created.status_code == 201
    assert created.json()["spec"]["dataset"]["rows"] == rows
    listed = api.client.get("/v1/jobs", headers=api.headers).json()["data"][0]
    assert listed["spec"]["dataset"]["row_count"] == 20
    generated = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers).json()
    listed = api.client.get("/v1/jobs", headers=api.headers).json()["data"][0]
    assert listed["id"] == generated["id"]
    assert "row_count" not in listed["spec"]["dataset"]  # a generator has no inline rows


@pytest.fixture
def big_body_api(
    backend: str, request: pytest.FixtureRequest, sqlite_dir: Path, queue_name: str
) -> Iterator[Api]:
    """An API that accepts the default 16 MiB bodies (the `api` fixture caps them at 256 KiB)."""
    url = request.getfixturevalue("pg_url") if backend == "postgres" else ""
    settings = settings_for(backend, url, sqlite_dir, queue_name)
    key, project_id = new_project_key(settings)
    with TestClient(create_app(settings)) as client:
        yield Api(client, settings, key, project_id)


class _NoDispatch:
    def send(self, job_id: str, queue: str | None = None) -> bool:
        return True


def test_large_inline_rows_are_stored_as_a_file_the_worker_reads(big_body_api: Api) -> None:
    api = big_body_api
    rows = inline_rows(2_000)  # ~450 KB of JSON lines
    assert sum(len(json.dumps(r)) + 1 for r in rows) > SPILL_INLINE_ROWS_BYTES
    created = api.client.post("/v1/jobs", json=spec_with_rows(rows), headers=api.headers)
    assert created.status_code == 201, created.text
    dataset = created.json()["spec"]["dataset"]
    assert dataset["rows"] is None and dataset["file_id"].startswith("file")
    file = api.client.get(f"/v1/files/{dataset['file_id']}", headers=api.headers).json()
    assert file["row_count"] == 2_000 and file["filename"] == "inline-rows.jsonl"
    # The job row itself is small now, and GET shows what is stored.
    job = api.client.get(f"/v1/jobs/{created.json()['id']}", headers=api.headers).json()
    assert len(json.dumps(job["spec"])) < 10_000
    # The worker resolves the file into exactly the rows that were sent, in order.
    ws = build_worker_settings(
        data_dir=api.settings.data_dir,
        database_url=api.settings.resolved_database_url,
        broker_url=api.settings.resolved_broker_url,
    )
    engine = make_engine(ws.resolved_database_url)
    try:
        ctx = WorkerContext(ws, make_session_factory(engine), _NoDispatch())
        with session_scope(ctx.sessions) as session:
            stored = jobs_repo.get(session, job_id=created.json()["id"])
            assert stored is not None
            spec = load_spec(ctx, stored)
    finally:
        engine.dispose()
    assert [r.model_dump() for r in spec.dataset.all_rows()] == [
        {"prompt": r["prompt"], "answer": r["answer"]} for r in rows
    ]
    # Another project cannot use the file by id.
    other_key, _ = api.new_key()
    other = api.client.post(
        "/v1/jobs",
        json=tiny_spec() | {"dataset": {"file_id": dataset["file_id"]}},
        headers={"Authorization": f"Bearer {other_key}"},
    )
    assert other.status_code == 422 and other.json()["error"]["param"] == "dataset.file_id"
