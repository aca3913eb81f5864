"""Resuming a paused job with changed settings (issue 45): POST /v1/jobs/{id}/resume with
``{"set": {...}}``, so the mismatch guard's advice (lower the learning rate or max_staleness,
then resume) can be followed through the API. The trainer's side of each change:
tests/trainer/run/test_async_resume_staleness.py."""

from __future__ import annotations

from typing import Any

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.models import Job
from app.jobs import transitions
from app.jobs.transitions import JobStatus
from tests.conftest import Api, tiny_spec


def paused_job(api: Api, **grpo: object) -> str:
    response = api.client.post("/v1/jobs", json=tiny_spec(**grpo), headers=api.headers)
    assert response.status_code == 201, response.text
    job_id = str(response.json()["id"])
    paused = api.client.post(f"/v1/jobs/{job_id}/pause", headers=api.headers)
    assert paused.json()["status"] == "paused"
    return job_id


def resume(api: Api, job_id: str, changes: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = api.client.post(
        f"/v1/jobs/{job_id}/resume", json={"set": changes}, headers=api.headers
    )
    return response.status_code, response.json()


def job(api: Api, job_id: str) -> dict[str, Any]:
    body: dict[str, Any] = api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json()
    return body


def refusal(body: dict[str, Any]) -> tuple[str, str]:
    error = body["error"]
    return error["param"], error["message"]


def test_a_paused_job_resumes_with_the_guards_advice_applied(api: Api) -> None:
    job_id = paused_job(api, learning_rate=1e-4, **{"async": {"max_staleness": 2}})
    changes = {
        "grpo.learning_rate": 1e-5,
        "grpo.async.max_staleness": 1,
        "grpo.async.max_capped_frac": 0.5,
        "grpo.steps": 5,
    }
    code, body = resume(api, job_id, changes)
    assert (code, body["status"]) == (200, "queued")
    grpo = job(api, job_id)["spec"]["grpo"]
    assert grpo["learning_rate"] == 1e-5 and grpo["steps"] == 5
    assert grpo["async"]["max_staleness"] == 1 and grpo["async"]["max_capped_frac"] == 0.5
    assert grpo["async"]["max_mismatch"] == 1.5  # what was not set stays
    assert body["progress"]["total_steps"] == 5
    events = api.client.get(f"/v1/jobs/{job_id}/events", headers=api.headers).json()["data"]
    resumed = [e for e in events if e["type"] == "status" and e["data"]["to"] == "queued"]
    assert "grpo.learning_rate 0.0001 -> 1e-05" in resumed[-1]["message"]
    assert "grpo.async.max_staleness 2 -> 1" in resumed[-1]["message"]
    # The same request again (a retry after a lost answer) finds it done: the job as is.
    again, body = resume(api, job_id, changes)
    assert (again, body["status"]) == (200, "queued")


def test_a_field_a_resume_may_not_change_is_refused_naming_it(api: Api) -> None:
    job_id = paused_job(api)
    for field in ("grpo.temperature", "model", "grpo.async", "seed"):
        code, body = resume(api, job_id, {"grpo.learning_rate": 1e-5, field: 1})
        assert code == 422, field
        param, message = refusal(body)
        assert param == field and "cannot be changed on resume" in message
        assert "grpo.learning_rate" in message  # and says what may
    other = api.client.post(
        f"/v1/jobs/{job_id}/resume", json={"learning_rate": 1e-5}, headers=api.headers
    )
    assert other.status_code == 422 and refusal(other.json())[0] == "learning_rate"  # only `set`
    assert job(api, job_id)["status"] == "paused"  # nothing changed, nothing queued
    assert job(api, job_id)["spec"]["grpo"]["learning_rate"] != 1e-5


def test_a_value_the_spec_refuses_is_a_422_naming_the_field(api: Api) -> None:
    job_id = paused_job(api)
    for field, value in (
        ("grpo.learning_rate", -1.0),
        ("grpo.async.max_staleness", 9),
        ("grpo.async.max_mismatch", 1.0),
        ("grpo.steps", 0),
    ):
        code, body = resume(api, job_id, {field: value})
        assert code == 422, field
        assert refusal(body)[0] == field
    assert job(api, job_id)["status"] == "paused"


def test_fewer_steps_than_the_job_trained_are_refused(api: Api) -> None:
    job_id = paused_job(api, steps=10)
    sessions = make_session_factory(make_engine(api.settings.resolved_database_url))
    with session_scope(sessions) as session:
        stored = session.get(Job, job_id)
        assert stored is not None
        stored.current_step = 6
    code, body = resume(api, job_id, {"grpo.steps": 5})
    assert code == 422
    param, message = refusal(body)
    assert param == "grpo.steps" and "below the 6 steps the job has trained" in message
    assert resume(api, job_id, {"grpo.steps": 6})[0] == 200


def test_changes_wait_for_a_paused_job(api: Api) -> None:
    response = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers)
    job_id = str(response.json()["id"])  # queued, never paused
    code, body = resume(api, job_id, {"grpo.learning_rate": 1e-5})
    assert code == 409 and body["error"]["type"] == "invalid_state"
    assert "not paused" in body["error"]["message"]
    assert job(api, job_id)["spec"]["grpo"]["learning_rate"] != 1e-5
    api.client.post(f"/v1/jobs/{job_id}/cancel", headers=api.headers)
    code, body = resume(api, job_id, {"grpo.learning_rate": 1e-5})
    assert code == 409 and "has ended" in body["error"]["message"]


def failed_job(api: Api, **grpo: object) -> str:
    """A job whose worker ran it to a failure (claimed, then failed with an error)."""
    response = api.client.post("/v1/jobs", json=tiny_spec(**grpo), headers=api.headers)
    job_id = str(response.json()["id"])
    sessions = make_session_factory(make_engine(api.settings.resolved_database_url))
    with session_scope(sessions) as session:
        stored = session.get(Job, job_id)
        assert stored is not None
        stored.attempt = stored.max_attempts - 1  # its last attempt (a worker lost twice)
    with session_scope(sessions) as session:
        assert transitions.claim(session, job_id, "worker-a") == api.settings.max_attempts
    with session_scope(sessions) as session:
        transitions.transition(
            session,
            job_id,
            JobStatus.FAILED,
            error_code="mismatch_guard",
            message="the engine's mismatch went past 1.5",
        )
    assert job(api, job_id)["status"] == "failed"
    return job_id


def test_a_failed_job_resumes_from_its_checkpoint_with_its_error_cleared(api: Api) -> None:
    """Issue 45: a failed job (the guard's advice, a worker lost too often) can follow the
    advice: it resumes, with changes or without, from its last checkpoint; its error and end
    are cleared and a worker may claim it again (a fresh allowance of attempts)."""
    job_id = failed_job(api, learning_rate=1e-4)
    code, body = resume(api, job_id, {"grpo.learning_rate": 1e-5})
    assert (code, body["status"]) == (200, "queued")
    assert body["error"] is None and body["finished_at"] is None
    assert job(api, job_id)["spec"]["grpo"]["learning_rate"] == 1e-5
    events = api.client.get(f"/v1/jobs/{job_id}/events", headers=api.headers).json()["data"]
    resumed = [e for e in events if e["type"] == "status" and e["data"]["to"] == "queued"][-1]
    assert (resumed["data"]["from"], resumed["level"]) == ("failed", "info")
    assert "after it failed (mismatch_guard)" in resumed["message"]
    sessions = make_session_factory(make_engine(api.settings.resolved_database_url))
    with session_scope(sessions) as session:
        owner_attempt = transitions.claim(session, job_id, "worker-b")
    assert owner_attempt == api.settings.max_attempts + 1  # claimable; attempts stay ordered


def test_a_failed_job_resumes_without_changes_and_a_deleted_one_does_not(api: Api) -> None:
    job_id = failed_job(api)
    plain = api.client.post(f"/v1/jobs/{job_id}/resume", headers=api.headers)
    assert (plain.status_code, plain.json()["status"]) == (200, "queued")

    gone = failed_job(api)
    assert api.client.delete(f"/v1/jobs/{gone}", headers=api.headers).status_code == 200
    after = api.client.post(f"/v1/jobs/{gone}/resume", headers=api.headers)
    assert after.status_code == 404
