"""A deployment of its own for the tests of size classes and of what waits for workers: the
real app on its own queue name (so no other test's workers count), a broker stand-in, and the
workers table that workers announce themselves in."""

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
    def __init__(self, settings: Settings, dispatcher: RecordingDispatcher, api: Api) -> None:
        self.settings = settings
        self.dispatcher = dispatcher
        self.api = api
        self.engine = make_engine(settings.resolved_database_url)
        self.sessions = make_session_factory(self.engine)

    def worker_seen(
        self, devices: int, *, tinker_models: int = 0, device: tuple[int, str] | None = None
    ) -> str:
        """A worker of `devices` devices, holding `tinker_models` Tinker training clients, on
        `device` (bytes, kind), announces itself, as each does every maintenance pass
        (worker.maintenance.announce_worker); returns its name."""
        name = f"worker-{secrets.token_hex(4)}"
        with session_scope(self.sessions) as session:
            workers_repo.announce(
                session,
                name=name,
                queue_name=self.settings.queue_name,
                devices=devices,
                now=utcnow(),
                tinker_models=tinker_models,
                device=device,
            )
        return name

    def spec(self, devices: int, **extra: Any) -> dict[str, Any]:
        return tiny_spec(prompts_per_step=2 * devices) | {"resources": {"devices": devices}} | extra

    def post(self, devices: int, path: str = "/v1/jobs", **extra: Any) -> Any:
        return self.api.client.post(
            path, json=self.spec(devices, **extra), headers=self.api.headers
        )

    def create(self, devices: int) -> dict[str, Any]:
        response = self.post(devices)
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    def validate(self, devices: int, **extra: Any) -> list[str]:
        """The dry run's warnings."""
        response = self.post(devices, "/v1/jobs/validate", **extra)
        assert response.status_code == 200, response.text
        return list(response.json()["warnings"])

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
    started: list[Deployment] = []

    def start(**extra: object) -> Deployment:
        own_queue = f"{queue_name}-{secrets.token_hex(3)}"
        settings = settings_for(backend, url, sqlite_dir, own_queue, **extra)
        dispatcher = RecordingDispatcher()
        client = TestClient(create_app(settings, dispatcher))
        client.__enter__()
        clients.append(client)
        key, project_id = new_project_key(settings)
        started.append(Deployment(settings, dispatcher, Api(client, settings, key, project_id)))
        return started[-1]

    yield start
    for client in clients:
        client.__exit__(None, None, None)
    for service in started:
        service.engine.dispose()
