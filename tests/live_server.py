"""The real API served by uvicorn on a free port, for tests that need real HTTP (many open
streams, clients such as the openai SDK)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI

from app.core.queue import Dispatcher
from app.core.settings import Settings
from app.main import create_app
from tests.conftest import free_port, new_project_key, tiny_spec, wait_until


@dataclass
class Server:
    url: str
    app: FastAPI
    settings: Settings

    def key(self) -> dict[str, str]:
        """Authorization headers of a new key in a new project."""
        key, _ = new_project_key(self.settings)
        return {"Authorization": f"Bearer {key}"}

    def new_job(self, headers: dict[str, str]) -> str:
        response = httpx.post(f"{self.url}/v1/jobs", json=tiny_spec(), headers=headers)
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def stream_url(self, job_id: str) -> str:
        return f"{self.url}/v1/jobs/{job_id}/stream"

    @property
    def open_streams(self) -> int:
        return self.app.state.grpo.limits.streams.open  # type: ignore[no-any-return]


@contextmanager
def serve(settings: Settings, dispatcher: Dispatcher | None = None) -> Iterator[Server]:
    """The real app on a free port, in a thread (signal handlers stay with pytest); without a
    `dispatcher`, jobs go to the broker as in production."""
    app = create_app(settings, dispatcher)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5
        )
    )
    thread = threading.Thread(target=server.run, name="streams-api", daemon=True)
    thread.start()

    def started() -> bool:
        if not thread.is_alive():
            raise RuntimeError("the API server thread died")
        return bool(server.started)

    wait_until(started, 20, "the API server to start", interval=0.05)
    try:
        yield Server(f"http://127.0.0.1:{port}", app, settings)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        app.state.grpo.engine.dispose()
