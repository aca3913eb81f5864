"""Idempotency-Key: replay, mismatch, in-flight duplicate, concurrency."""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.models import IdempotencyRecord
from app.jobs.idempotency import STALE_CLAIM, spec_fingerprint
from jobspec import JobSpec
from tests.conftest import Api, tiny_spec


def test_same_key_and_body_returns_the_original_response(api: Api) -> None:
    key = secrets.token_hex(8)
    first = api.client.post(
        "/v1/jobs", json=tiny_spec(), headers=api.headers | {"Idempotency-Key": key}
    )
    again = api.client.post(
        "/v1/jobs", json=tiny_spec(), headers=api.headers | {"Idempotency-Key": key}
    )
    assert first.status_code == again.status_code == 201
    assert again.json() == first.json()
    assert again.headers.get("Idempotent-Replayed") == "true"
    listed = api.client.get("/v1/jobs", headers=api.headers).json()["data"]
    assert [j["id"] for j in listed] == [first.json()["id"]]


def test_same_key_other_body_is_422(api: Api) -> None:
    key = secrets.token_hex(8)
    api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers | {"Idempotency-Key": key})
    other = api.client.post(
        "/v1/jobs", json=tiny_spec(steps=3), headers=api.headers | {"Idempotency-Key": key}
    )
    assert other.status_code == 422
    assert other.json()["error"]["type"] == "idempotency_key_reused"
    assert other.json()["error"]["param"] == "Idempotency-Key"


def test_keys_are_scoped_to_the_project(api: Api) -> None:
    key = secrets.token_hex(8)
    mine = api.client.post(
        "/v1/jobs", json=tiny_spec(), headers=api.headers | {"Idempotency-Key": key}
    )
    other_key, _ = api.new_key()
    theirs = api.client.post(
        "/v1/jobs",
        json=tiny_spec(steps=5),
        headers={"Authorization": f"Bearer {other_key}", "Idempotency-Key": key},
    )
    assert theirs.status_code == 201
    assert theirs.json()["id"] != mine.json()["id"]


def test_duplicate_while_first_is_in_flight_is_409(api: Api) -> None:
    # The first request has claimed the key but not finished: simulate exactly that state.
    key = secrets.token_hex(8)
    engine = make_engine(api.settings.resolved_database_url)
    fingerprint = spec_fingerprint(JobSpec.model_validate(tiny_spec()).model_dump(mode="json"))
    with session_scope(make_session_factory(engine)) as session:
        session.add(
            IdempotencyRecord(
                project_id=api.project_id, key=key, request_hash=fingerprint, state="in_progress"
            )
        )
    engine.dispose()
    response = api.client.post(
        "/v1/jobs", json=tiny_spec(), headers=api.headers | {"Idempotency-Key": key}
    )
    assert response.status_code == 409
    assert response.json()["error"]["type"] == "conflict"


def test_concurrent_duplicates_create_one_job(api: Api) -> None:
    key = secrets.token_hex(8)
    headers = api.headers | {"Idempotency-Key": key}

    def post(_: int) -> tuple[int, str | None]:
        r = api.client.post("/v1/jobs", json=tiny_spec(), headers=headers)
        return r.status_code, r.json().get("id")

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(post, range(6)))
    statuses = sorted(code for code, _ in results)
    assert set(statuses) <= {201, 409}
    created_ids = {job_id for code, job_id in results if code == 201}
    assert len(created_ids) == 1
    listed = api.client.get("/v1/jobs", headers=api.headers).json()["data"]
    assert len(listed) == 1


def test_blank_key_is_rejected(api: Api) -> None:
    response = api.client.post(
        "/v1/jobs", json=tiny_spec(), headers=api.headers | {"Idempotency-Key": "  "}
    )
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "Idempotency-Key"


def _stored_claim(api: Api, key: str, *, age: timedelta, state: str, request_hash: str) -> None:
    """A record of `key` as an earlier request left it, `age` ago."""
    engine = make_engine(api.settings.resolved_database_url)
    with session_scope(make_session_factory(engine)) as session:
        session.add(
            IdempotencyRecord(
                project_id=api.project_id,
                key=key,
                request_hash=request_hash,
                state=state,
                response_status=201 if state == "completed" else None,
                response_body={"id": "job_from_long_ago"} if state == "completed" else None,
                created_at=utcnow() - age,
            )
        )
    engine.dispose()


def test_a_key_past_its_time_to_live_is_claimed_afresh(api: Api) -> None:
    # Stored for another body a day ago: past the TTL, so neither a replay nor a mismatch.
    key = secrets.token_hex(8)
    ttl = timedelta(hours=api.settings.idempotency_ttl_hours)
    _stored_claim(api, key, age=ttl + timedelta(minutes=1), state="completed", request_hash="x")
    response = api.client.post(
        "/v1/jobs", json=tiny_spec(), headers=api.headers | {"Idempotency-Key": key}
    )
    assert response.status_code == 201, response.text
    assert response.json()["id"] != "job_from_long_ago"
    assert "Idempotent-Replayed" not in response.headers
    again = api.client.post(
        "/v1/jobs", json=tiny_spec(), headers=api.headers | {"Idempotency-Key": key}
    )
    assert again.json()["id"] == response.json()["id"]  # the new record is the one replayed


def test_a_key_within_its_time_to_live_is_still_replayed(api: Api) -> None:
    key = secrets.token_hex(8)
    fingerprint = spec_fingerprint(JobSpec.model_validate(tiny_spec()).model_dump(mode="json"))
    ttl = timedelta(hours=api.settings.idempotency_ttl_hours)
    age = ttl - timedelta(minutes=1)
    _stored_claim(api, key, age=age, state="completed", request_hash=fingerprint)
    response = api.client.post(
        "/v1/jobs", json=tiny_spec(), headers=api.headers | {"Idempotency-Key": key}
    )
    assert response.status_code == 201
    assert response.json() == {"id": "job_from_long_ago"}
    assert response.headers.get("Idempotent-Replayed") == "true"


def test_a_claim_whose_request_died_is_released_for_the_retry(api: Api) -> None:
    # In progress for longer than any request takes: its request died mid-way. The first retry
    # is told to retry (409) and the claim is released, so the next one creates the job.
    key = secrets.token_hex(8)
    fingerprint = spec_fingerprint(JobSpec.model_validate(tiny_spec()).model_dump(mode="json"))
    age = STALE_CLAIM + timedelta(seconds=5)
    _stored_claim(api, key, age=age, state="in_progress", request_hash=fingerprint)
    headers = api.headers | {"Idempotency-Key": key}
    first = api.client.post("/v1/jobs", json=tiny_spec(), headers=headers)
    assert first.status_code == 409
    assert "did not finish" in first.json()["error"]["message"]
    second = api.client.post("/v1/jobs", json=tiny_spec(), headers=headers)
    assert second.status_code == 201, second.text
