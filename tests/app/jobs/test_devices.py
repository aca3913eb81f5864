"""Multi-device jobs at the API: the operator's bound on a job's `resources.devices` (a 422
naming the field), the queue of each job's size class, the per-project device quota (a 429 like
the active-job quota) and the figures GET /v1/usage shows for both quotas."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.models import Job
from app.core.queue import queue_for
from app.core.settings import Settings
from app.main import create_app
from tests.app.fine_tuning.test_fine_tuning_api import ROWS, upload
from tests.app.fine_tuning.test_fine_tuning_api import request as fine_tuning_request
from tests.conftest import Api, RecordingDispatcher, new_project_key, settings_for, tiny_spec


@dataclass
class Service:
    api: Api
    dispatcher: RecordingDispatcher

    @property
    def client(self) -> TestClient:
        return self.api.client

    @property
    def headers(self) -> dict[str, str]:
        return self.api.headers

    def post(self, devices: int, path: str = "/v1/jobs") -> Any:
        spec = devices_spec(devices)
        return self.client.post(path, json=spec, headers=self.headers)

    def create(self, devices: int) -> str:
        response = self.post(devices)
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def act(self, job_id: str, action: str) -> str:
        """POST /v1/jobs/{id}/<action>; the job's status after it."""
        response = self.client.post(f"/v1/jobs/{job_id}/{action}", headers=self.headers)
        assert response.status_code == 200, response.text
        return str(response.json()["status"])

    def job_quota(self) -> dict[str, int]:
        usage = self.client.get("/v1/usage", headers=self.headers)
        assert usage.status_code == 200, usage.text
        quota: dict[str, int] = usage.json()["job_quota"]
        return quota

    def stored(self, job_id: str) -> tuple[str, int]:
        """The job's recorded queue and devices."""
        engine = make_engine(self.api.settings.resolved_database_url)
        try:
            with session_scope(make_session_factory(engine)) as session:
                row = session.execute(select(Job.queue, Job.devices).where(Job.id == job_id)).one()
                return str(row[0]), int(row[1])
        finally:
            engine.dispose()


@pytest.fixture
def make_service(
    backend: str, request: pytest.FixtureRequest, sqlite_dir: Path, queue_name: str
) -> Iterator[Callable[..., Service]]:
    """The real app with extra operator settings, sending to a broker stand-in that records
    each job's queue."""
    url = request.getfixturevalue("pg_url") if backend == "postgres" else ""
    clients: list[TestClient] = []

    def start(**extra: object) -> Service:
        settings: Settings = settings_for(backend, url, sqlite_dir, queue_name, **extra)
        dispatcher = RecordingDispatcher()
        client = TestClient(create_app(settings, dispatcher))
        client.__enter__()
        clients.append(client)
        key, project_id = new_project_key(settings)
        return Service(Api(client, settings, key, project_id), dispatcher)

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def test_the_queue_of_a_size_class_is_named_from_the_base_queue() -> None:
    assert queue_for("grpo-jobs", 1) == "grpo-jobs"  # one device: the queue as it always was
    assert queue_for("grpo-jobs", 2) == "grpo-jobs-2dev"
    assert queue_for("gpu", 8) == "gpu-8dev"
    with pytest.raises(ValueError):
        queue_for("grpo-jobs", 0)


def test_more_devices_than_the_operator_allows_is_a_422_naming_resources_devices(
    make_service: Callable[..., Service],
) -> None:
    service = make_service(max_devices_per_job=2)
    for path in ("/v1/jobs", "/v1/jobs/validate"):
        refused = service.post(3, path)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["param"] == "resources.devices" and error["code"] == "invalid_value"
        assert "GRPO_MAX_DEVICES_PER_JOB" in error["message"] and "at most 2" in error["message"]
    assert service.post(2, "/v1/jobs/validate").status_code == 200
    service.create(2)
    # Beyond the spec's own bound, whatever the operator allows: the same field named.
    beyond = service.post(65)
    assert beyond.status_code == 422 and beyond.json()["error"]["param"] == "resources.devices"
    # Nor more than a project may ever hold at once: that 429 would never clear.
    small = make_service(max_devices_per_job=8, max_active_devices_per_project=4)
    refused = small.post(5)
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"] == "resources.devices"
    assert "GRPO_MAX_ACTIVE_DEVICES_PER_PROJECT" in refused.json()["error"]["message"]


def test_the_default_bound_is_8_devices(make_service: Callable[..., Service]) -> None:
    service = make_service()
    assert service.post(8, "/v1/jobs/validate").status_code == 200
    assert service.post(9, "/v1/jobs/validate").json()["error"]["param"] == "resources.devices"


def devices_spec(devices: int) -> dict[str, object]:
    """A tiny job on ``devices`` devices, its prompts per step a multiple of them (the spec
    asks every device for an equal share)."""
    return tiny_spec(prompts_per_step=2 * devices) | {"resources": {"devices": devices}}


def test_the_openai_face_carries_devices_in_its_extension_and_names_its_field(
    make_service: Callable[..., Service],
) -> None:
    service = make_service(max_devices_per_job=2)
    file_id = upload(service.api, ROWS)["id"]
    body = fine_tuning_request(file_id)
    body["grpo_service"] |= {"resources": {"devices": 3}}
    refused = service.client.post("/v1/fine_tuning/jobs", json=body, headers=service.headers)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "grpo_service.resources.devices"
    body["grpo_service"] |= {"resources": {"devices": 2}}
    created = service.client.post("/v1/fine_tuning/jobs", json=body, headers=service.headers)
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    assert service.stored(job_id) == (f"{service.api.settings.queue_name}-2dev", 2)


def test_each_job_is_sent_to_the_queue_of_its_size_class(
    make_service: Callable[..., Service],
) -> None:
    service = make_service()
    base = service.api.settings.queue_name
    one, two = service.create(1), service.create(2)  # the project's two dispatch slots
    assert service.dispatcher.queues == {one: base, two: f"{base}-2dev"}
    # Recorded on the job: every later re-send (sweep, reaper, hand-over, resume) reads it.
    assert service.stored(one) == (base, 1)
    assert service.stored(two) == (f"{base}-2dev", 2)
    read = service.client.get(f"/v1/jobs/{two}", headers=service.headers).json()
    assert read["devices"] == 2 and read["spec"]["resources"] == {"devices": 2}
    listed = service.client.get("/v1/jobs", headers=service.headers).json()["data"]
    assert {job["id"]: job["devices"] for job in listed} == {one: 1, two: 2}
    # A job without resources is a one-device job, in the queue one-device jobs always used.
    plain = service.client.post("/v1/jobs", json=tiny_spec(), headers=service.headers).json()
    assert plain["devices"] == 1 and service.stored(plain["id"]) == (base, 1)


def test_a_project_at_its_device_limit_gets_429_until_devices_free(
    make_service: Callable[..., Service],
) -> None:
    service = make_service(max_active_devices_per_project=4)
    limits = {"limit_jobs": 50, "limit_devices": 4}
    assert service.job_quota() == {"active_jobs": 0, "active_devices": 0} | limits
    first = service.create(2)
    service.create(2)
    assert service.job_quota() == {"active_jobs": 2, "active_devices": 4} | limits

    refused = service.post(1)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["type"] == "quota_exceeded" and error["param"] is None
    assert "max_active_devices_per_project=4" in error["message"]
    assert "5 devices" in error["message"]
    assert service.job_quota()["active_devices"] == 4  # the refused job is not stored
    # Another project has its own devices.
    key, _ = service.api.new_key()
    other = service.client.post(
        "/v1/jobs",
        json=devices_spec(4),
        headers={"Authorization": f"Bearer {key}"},
    )
    assert other.status_code == 201, other.text

    # A paused job holds no devices; resuming it past the limit is the same 429.
    assert service.act(first, "pause") == "paused"
    assert service.job_quota() == {"active_jobs": 1, "active_devices": 2} | limits
    service.create(1)
    resumed = service.client.post(f"/v1/jobs/{first}/resume", headers=service.headers)
    assert resumed.status_code == 429, resumed.text
    assert "max_active_devices_per_project=4" in resumed.json()["error"]["message"]
    still = service.client.get(f"/v1/jobs/{first}", headers=service.headers).json()
    assert still["status"] == "paused"
    assert service.job_quota() == {"active_jobs": 2, "active_devices": 3} | limits
    # An ended job frees its devices.
    assert service.act(first, "cancel") == "cancelled"
    service.create(1)
    assert service.job_quota() == {"active_jobs": 3, "active_devices": 4} | limits


def test_usage_shows_the_job_limit_next_to_the_device_limit(
    make_service: Callable[..., Service],
) -> None:
    service = make_service(max_active_jobs_per_project=3)
    service.create(2)
    assert service.job_quota() == {
        "active_jobs": 1,
        "limit_jobs": 3,
        "active_devices": 2,
        "limit_devices": 64,  # the default: above the default job limit (50)
    }
    schema = service.client.get("/openapi.json").json()
    assert "job_quota" in schema["components"]["schemas"]["UsageOut"]["required"]
    quota = schema["components"]["schemas"]["JobQuotaOut"]["properties"]
    assert "GRPO_MAX_ACTIVE_DEVICES_PER_PROJECT" in quota["limit_devices"]["description"]
    assert "GRPO_MAX_ACTIVE_JOBS_PER_PROJECT" in quota["limit_jobs"]["description"]


def test_devices_is_a_json_integer_not_text_or_a_boolean(
    make_service: Callable[..., Service],
) -> None:
    # Pydantic's lax mode read "2" as 2 and true as 1 device (issue 32).
    service = make_service()
    for devices in ("2", True, 2.0, "two"):
        spec = devices_spec(2) | {"resources": {"devices": devices}}
        for path in ("/v1/jobs", "/v1/jobs/validate"):
            refused = service.client.post(path, json=spec, headers=service.headers)
            assert refused.status_code == 422, (devices, path, refused.text)
            assert refused.json()["error"]["param"] == "resources.devices", devices
    assert service.post(2, "/v1/jobs/validate").status_code == 200


# One python tool: a job with it is an agent job, whose episodes the trainer runs on one device.
TOOL = {
    "type": "function",
    "function": {"name": "one", "parameters": {"type": "object", "properties": {}}},
    "implementation": {"type": "python", "source": "def one():\n    return '1'\n"},
}


def test_an_agent_job_the_trainer_would_refuse_is_refused_at_validation_naming_the_field(
    make_service: Callable[..., Service],
) -> None:
    # It validated, waited for a worker of its size, then failed with agents_not_supported.
    service = make_service()
    environment = {"type": "python", "source": "class Environment:\n    pass\n"}
    cases = [
        ({"tools": [TOOL], "resources": {"devices": 2}}, "resources.devices"),
        ({"environment": environment, "resources": {"devices": 2}}, "resources.devices"),
        (
            {
                "tools": [TOOL],
                "dataset": {"rows": [{"prompt": "q"}] * 8, "use_chat_template": False},
            },
            "dataset.use_chat_template",
        ),
    ]
    for changes, param in cases:
        spec = devices_spec(1) | {"dataset": {"rows": [{"prompt": "q"}] * 8}} | changes
        for path in ("/v1/jobs", "/v1/jobs/validate"):
            refused = service.client.post(path, json=spec, headers=service.headers)
            assert refused.status_code == 422, (param, path, refused.text)
            assert refused.json()["error"]["param"] == param, refused.text
    # The same agent job on one device, with the chat template, is accepted.
    fine = devices_spec(1) | {"tools": [TOOL], "dataset": {"rows": [{"prompt": "q"}] * 8}}
    accepted = service.client.post("/v1/jobs/validate", json=fine, headers=service.headers)
    assert accepted.status_code == 200, accepted.text
