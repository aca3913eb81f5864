"""Pause and resume through the API (the worker's side: tests/worker/test_runner.py)."""

from __future__ import annotations

from collections.abc import Callable

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.models import Job
from tests.conftest import Api, tiny_spec


def create(api: Api) -> str:
    response = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def control(api: Api, job_id: str, action: str) -> tuple[int, dict[str, object]]:
    response = api.client.post(f"/v1/jobs/{job_id}/{action}", headers=api.headers)
    return response.status_code, response.json()


def dispatched(api: Api, job_id: str) -> bool:
    sessions = make_session_factory(make_engine(api.settings.resolved_database_url))
    with session_scope(sessions) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job.dispatched_at is not None


def test_a_queued_job_pauses_at_once_and_resumes_into_the_queue(api: Api) -> None:
    job_id = create(api)
    assert dispatched(api, job_id)
    code, body = control(api, job_id, "pause")
    assert (code, body["status"]) == (200, "paused")
    assert control(api, job_id, "pause")[1]["status"] == "paused"  # idempotent
    listed = api.client.get("/v1/jobs?status=paused", headers=api.headers).json()["data"]
    assert [j["id"] for j in listed] == [job_id]

    code, body = control(api, job_id, "resume")
    assert (code, body["status"]) == (200, "queued")
    assert dispatched(api, job_id)  # sent again once the resume committed
    assert control(api, job_id, "resume")[1]["status"] == "queued"  # idempotent
    events = api.client.get(f"/v1/jobs/{job_id}/events", headers=api.headers).json()["data"]
    moves = [(e["data"]["from"], e["data"]["to"]) for e in events if e["type"] == "status"]
    assert moves == [("queued", "paused"), ("paused", "queued")]


def test_a_paused_job_can_be_cancelled_but_an_ended_one_neither_pauses_nor_resumes(
    api: Api,
) -> None:
    job_id = create(api)
    control(api, job_id, "pause")
    code, body = control(api, job_id, "cancel")
    assert (code, body["status"]) == (200, "cancelled")
    for action in ("pause", "resume"):
        code, body = control(api, job_id, action)
        assert code == 409, action
        error = body["error"]
        assert isinstance(error, dict) and (error["type"], error["param"]) == (
            "invalid_state",
            "job_id",
        )
    assert control(api, "job_doesnotexist", "pause")[0] == 404


def test_a_resume_past_the_projects_job_limit_is_429_and_leaves_it_paused(
    make_api: Callable[..., Api],
) -> None:
    api = make_api(max_active_jobs_per_project=1)
    first = create(api)
    control(api, first, "pause")  # a paused job holds no place: room for another
    second = create(api)
    code, body = control(api, first, "resume")
    assert code == 429
    error = body["error"]
    assert isinstance(error, dict) and error["type"] == "quota_exceeded"
    got = api.client.get(f"/v1/jobs/{first}", headers=api.headers).json()
    assert got["status"] == "paused"
    control(api, second, "cancel")
    assert control(api, first, "resume")[1]["status"] == "queued"
