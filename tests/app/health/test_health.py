"""/healthz and /readyz, including a broker that goes away."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from app.core.settings import Settings, build_settings
from app.main import create_app
from tests.conftest import Api, free_port, start_private_redis


def test_healthz_and_readyz_ok(api: Api) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok"}
    ready = api.client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok", "database": "ok", "broker": "ok"}


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_readyz_is_503_within_2s_when_redis_stops(pg_url: str, tmp_path: Path) -> None:
    port = free_port()
    proc = start_private_redis(port)
    try:
        client = redis.Redis(port=port)
        settings: Settings = build_settings(
            data_dir=tmp_path, database_url=pg_url, broker_url=f"redis://127.0.0.1:{port}/0"
        )
        with TestClient(create_app(settings)) as api:
            assert api.get("/readyz").status_code == 200
            client.shutdown(nosave=True)
            started = time.monotonic()
            response = api.get("/readyz")
            elapsed = time.monotonic() - started
        assert response.status_code == 503
        body = response.json()
        assert body["status"] == "unavailable" and body["database"] == "ok"
        assert body["broker"] != "ok"
        assert elapsed < 2.0
    finally:
        proc.kill()
        proc.wait()


def test_readyz_is_503_when_database_is_unreachable(tmp_path: Path) -> None:
    settings = build_settings(
        data_dir=tmp_path, database_url="postgresql+psycopg://postgres@127.0.0.1:1/none"
    )
    with TestClient(create_app(settings)) as api:
        started = time.monotonic()
        response = api.get("/readyz")
        assert time.monotonic() - started < 2.0
        assert response.status_code == 503
        assert response.json()["database"] != "ok"
        # and a normal request answers 503 with the error shape, never 500
        jobs = api.get("/v1/jobs", headers={"Authorization": "Bearer grpo_a_b"})
        assert jobs.status_code == 503
        assert jobs.json()["error"]["type"] == "service_unavailable"
        assert int(jobs.headers["Retry-After"]) > 0  # clients back off, then retry
