"""A job of a size no worker runs (issue 32, hostile tenant): it is told so at creation (a
warning in the answer and in the dry run, and a `no_worker` event), and it holds dispatch slots
of its own size class only, so the project's other jobs are sent to their workers at once.

Before, a project's two `devices: 2` jobs, with no two-device worker anywhere, held both of its
dispatch slots without a word, and its one-device job sat queued behind them."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings
from app.jobs import size_classes
from app.jobs import workers_repository as workers_repo
from app.main import create_app
from tests.conftest import Api, RecordingDispatcher, new_project_key, settings_for, tiny_spec


class Deployment:
    """The real app on its own queue name (so no other test's workers count), a broker
    stand-in, and the workers table that workers announce themselves in."""

    def __init__(self, settings: Settings, dispatcher: RecordingDispatcher, api: Api) -> None:
        self.settings = settings
        self.dispatcher = dispatcher
        self.api = api

    def worker_seen(self, devices: int) -> None:
        """A worker of `devices` devices announces itself, as each does every maintenance
        pass (worker.maintenance.announce_worker)."""
        engine = make_engine(self.settings.resolved_database_url)
        try:
            with session_scope(make_session_factory(engine)) as session:
                workers_repo.announce(
                    session,
                    name=f"worker-{secrets.token_hex(4)}",
                    queue_name=self.settings.queue_name,
                    devices=devices,
                    now=utcnow(),
                )
        finally:
            engine.dispose()

    def post(self, devices: int, path: str = "/v1/jobs") -> Any:
        spec = tiny_spec(prompts_per_step=2 * devices) | {"resources": {"devices": devices}}
        return self.api.client.post(path, json=spec, headers=self.api.headers)

    def create(self, devices: int) -> dict[str, Any]:
        response = self.post(devices)
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    def events(self, job_id: str) -> list[dict[str, Any]]:
        response = self.api.client.get(f"/v1/jobs/{job_id}/events", headers=self.api.headers)
        assert response.status_code == 200, response.text
        data: list[dict[str, Any]] = response.json()["data"]
        return data


@pytest.fixture
def deployment(
    backend: str,
    request: pytest.FixtureRequest,
    sqlite_dir: Path,
    queue_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., Deployment]]:
    # Every create reads the workers table afresh (a process otherwise trusts a read for 10 s).
    monkeypatch.setattr(size_classes, "REFRESH_S", 0.0)
    url = request.getfixturevalue("pg_url") if backend == "postgres" else ""
    clients: list[TestClient] = []

    def start(**extra: object) -> Deployment:
        own_queue = f"{queue_name}-{secrets.token_hex(3)}"
        settings = settings_for(backend, url, sqlite_dir, own_queue, **extra)
        dispatcher = RecordingDispatcher()
        client = TestClient(create_app(settings, dispatcher))
        client.__enter__()
        clients.append(client)
        key, project_id = new_project_key(settings)
        return Deployment(settings, dispatcher, Api(client, settings, key, project_id))

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def test_a_job_of_a_size_no_worker_runs_is_told_so_and_never_holds_up_the_projects_others(
    deployment: Callable[..., Deployment],
) -> None:
    service = deployment()
    service.worker_seen(devices=1)  # the deployment runs one-device workers only

    # Two two-device jobs: as many as the project may have sent at once (the default cap, 2).
    big = [service.create(2) for _ in range(2)]
    for job in big:
        (warning,) = job["warnings"]
        assert "no worker of 2 device(s)" in warning and "GRPO_WORKER_DEVICES=2" in warning
        (event,) = [e for e in service.events(job["id"]) if e["type"] == "no_worker"]
        assert (event["level"], event["message"]) == ("warning", warning)
        assert event["data"] == {"devices": 2}
    dry_run = service.post(2, "/v1/jobs/validate")
    assert dry_run.status_code == 200 and big[0]["warnings"][0] in dry_run.json()["warnings"]

    # The project's one-device job goes to its workers at once: the waiting two-device jobs
    # hold their own size class's slots, not the ones it needs.
    small = service.create(1)
    assert small["warnings"] == [] and service.dispatcher.sent[-1] == small["id"]
    assert service.dispatcher.queues[small["id"]] == service.settings.queue_name
    assert [e["type"] for e in service.events(small["id"])] == ["created"]


def test_nothing_is_said_while_no_worker_was_seen_or_once_one_of_the_size_runs(
    deployment: Callable[..., Deployment],
) -> None:
    service = deployment()
    # No worker seen at all (a fresh start, workers starting after the API): nothing is known.
    assert service.create(2)["warnings"] == []
    service.worker_seen(devices=1)
    assert len(service.create(2)["warnings"]) == 1
    service.worker_seen(devices=2)
    assert service.create(2)["warnings"] == []
    assert service.post(2, "/v1/jobs/validate").json()["warnings"] == []


def test_a_slot_freed_in_one_size_class_goes_to_that_class(
    deployment: Callable[..., Deployment],
) -> None:
    """The refill after a job's end (and the sweep, through the same fill_slots) sends the
    oldest waiting job of a size class that has a free slot, never one whose class is full."""
    service = deployment(max_dispatched_per_project=1)
    one, two = service.create(1)["id"], service.create(2)["id"]  # each class's one slot
    waiting_one, waiting_two = service.create(1)["id"], service.create(2)["id"]
    assert service.dispatcher.sent == [one, two]

    cancelled = service.api.client.post(f"/v1/jobs/{one}/cancel", headers=service.api.headers)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert service.dispatcher.sent == [one, two, waiting_one]
    cancelled = service.api.client.post(f"/v1/jobs/{two}/cancel", headers=service.api.headers)
    assert cancelled.status_code == 200
    assert service.dispatcher.sent == [one, two, waiting_one, waiting_two]
