"""`grpo submit --webhook URL` against the real API served over HTTP (uvicorn on a free port):
the project's endpoint is created once (its secret printed once) before the job, reused by
later submits, and a refused URL is a usage error that submits nothing."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from app.core.settings import Settings
from app.main import create_app
from app.webhooks.protocol import EVENT_TYPES
from grpo_cli.ci_args import WEBHOOK_EVENTS, Exit
from grpo_cli.main import main
from tests.conftest import RecordingDispatcher, free_port, new_project_key, tiny_spec, wait_until


@dataclass
class Served:
    url: str
    key: str

    def get(self, path: str) -> Any:
        headers = {"Authorization": f"Bearer {self.key}"}
        response = httpx.get(f"{self.url}{path}", headers=headers, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()


def _serve(settings: Settings) -> Iterator[Served]:
    app = create_app(settings, RecordingDispatcher())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="cli-webhook-api", daemon=True)
    thread.start()
    wait_until(lambda: server.started, 20, "the API server to start", interval=0.05)
    try:
        yield Served(f"http://127.0.0.1:{port}", new_project_key(settings)[0])
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        app.state.grpo.engine.dispose()


@pytest.fixture
def served(settings: Settings) -> Iterator[Served]:
    """Local receivers allowed, as the webhook tests run them on 127.0.0.1."""
    yield from _serve(settings.model_copy(update={"webhook_allow_private": True}))


@pytest.fixture
def strict(settings: Settings) -> Iterator[Served]:
    yield from _serve(settings.model_copy(update={"webhook_allow_private": False}))


@pytest.fixture
def spec_file(tmp_path: Path) -> str:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(tiny_spec()))
    return str(path)


def _submit(
    served: Served, spec: str, hook: str, capsys: pytest.CaptureFixture[str]
) -> tuple[int, dict[str, Any]]:
    args = ["submit", spec, "--api-url", served.url, "--api-key", served.key]
    code = main([*args, "--webhook", hook, "--json", "--no-idempotency-key"])
    return code, json.loads(capsys.readouterr().out)


def test_the_events_are_the_services() -> None:
    assert WEBHOOK_EVENTS == EVENT_TYPES


def test_submit_creates_the_webhook_once(
    served: Served, spec_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    hook = "http://127.0.0.1:9/ci-hook"
    code, first = _submit(served, spec_file, hook, capsys)
    assert code == Exit.OK, first
    assert first["webhook"]["created"] is True
    assert first["webhook"]["secret"].startswith("whsec_")
    code, second = _submit(served, spec_file, hook, capsys)
    assert code == Exit.OK, second
    assert second["webhook"]["created"] is False
    assert second["webhook"]["id"] == first["webhook"]["id"]
    assert "secret" not in second["webhook"]

    [endpoint] = served.get("/v1/webhooks")["data"]
    assert endpoint["url"] == hook and sorted(endpoint["events"]) == sorted(EVENT_TYPES)
    jobs = served.get("/v1/jobs")["data"]
    assert {j["id"] for j in jobs} == {first["job"]["id"], second["job"]["id"]}


def test_a_refused_url_submits_nothing(
    strict: Served, spec_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["submit", spec_file, "--api-url", strict.url, "--api-key", strict.key]
    code = main([*args, "--webhook", "http://10.0.0.1/hook", "--no-idempotency-key"])
    assert code == Exit.USAGE
    assert "url" in capsys.readouterr().err
    assert strict.get("/v1/jobs")["data"] == []
    assert strict.get("/v1/webhooks")["data"] == []
