"""Fixtures of the API tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from tests.conftest import Api, new_project_key, settings_for


@pytest.fixture
def make_api(
    backend: str, request: pytest.FixtureRequest, sqlite_dir: Path, queue_name: str
) -> Iterator[Callable[..., Api]]:
    """Start the real app with extra operator settings; every app started is closed at the end."""
    url = request.getfixturevalue("pg_url") if backend == "postgres" else ""
    clients: list[TestClient] = []

    def start(**extra: object) -> Api:
        cfg = settings_for(backend, url, sqlite_dir, queue_name, **extra)
        key, project_id = new_project_key(cfg)
        client = TestClient(create_app(cfg))
        client.__enter__()
        clients.append(client)
        return Api(client, cfg, key, project_id)

    yield start
    for client in clients:
        client.__exit__(None, None, None)
