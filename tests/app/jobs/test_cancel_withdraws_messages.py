"""A cancelled job's message leaves the broker (issue 44): before, it stayed in the queue until a
worker took it only to drop it, and in a queue no worker consumes (a size class nobody runs)
for good. Against the real brokers: Redis (the deployment's) and the embedded filesystem
broker; read here as each stores its messages (a Redis list per queue, a file per message)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from app.core.settings import Settings
from app.main import create_app
from tests.conftest import free_port, new_project_key, start_private_redis, tiny_spec


@dataclass
class Service:
    client: TestClient
    settings: Settings
    headers: dict[str, str]

    @property
    def queue(self) -> str:
        """The queue of two-device jobs: no worker of the test session consumes it."""
        return f"{self.settings.queue_name}-2dev"

    def create(self) -> str:
        spec = tiny_spec(prompts_per_step=4) | {"resources": {"devices": 2}}
        response = self.client.post("/v1/jobs", json=spec, headers=self.headers)
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def act(self, job_id: str, action: str) -> dict[str, Any]:
        response = self.client.post(f"/v1/jobs/{job_id}/{action}", headers=self.headers)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def waiting_messages(self) -> list[bytes]:
        """The raw messages waiting in the broker's queue."""
        if self.settings.resolved_broker_url.startswith("redis://"):
            client = redis.Redis.from_url(self.settings.resolved_broker_url)
            return list(client.lrange(self.queue, 0, -1))
        folder = self.settings.broker_folder / "queue"
        names = [p for p in folder.iterdir() if p.name.endswith(f".{self.queue}.msg")]
        return [p.read_bytes() for p in names]

    def messages_of(self, job_id: str) -> int:
        return sum(job_id.encode() in raw for raw in self.waiting_messages())

    def drain(self) -> None:
        """Leave nothing in the shared broker."""
        if self.settings.resolved_broker_url.startswith("redis://"):
            redis.Redis.from_url(self.settings.resolved_broker_url).delete(self.queue)
        else:
            for path in (self.settings.broker_folder / "queue").glob(f"*.{self.queue}.msg"):
                path.unlink()


@contextmanager
def running(settings: Settings) -> Iterator[Service]:
    """The app with the real dispatcher (its default) on a queue name of its own."""
    settings.queue_name = f"{settings.queue_name}-{secrets.token_hex(3)}"
    key, _ = new_project_key(settings)
    with TestClient(create_app(settings)) as client:
        yield Service(client, settings, {"Authorization": f"Bearer {key}"})


@pytest.fixture
def service(settings: Settings) -> Iterator[Service]:
    with running(settings) as started:
        yield started
        started.drain()


def test_a_cancelled_or_paused_queued_jobs_message_leaves_the_broker(service: Service) -> None:
    cancelled, paused, kept = service.create(), service.create(), service.create()
    assert service.messages_of(cancelled) == service.messages_of(paused) == 1
    assert service.messages_of(kept) == 0  # waits for a dispatch slot (2 per project)

    assert service.act(cancelled, "cancel")["status"] == "cancelled"
    assert service.messages_of(cancelled) == 0
    # The freed slot went to the waiting job: its message is there, the others untouched.
    assert service.messages_of(kept) == service.messages_of(paused) == 1

    assert service.act(paused, "pause")["status"] == "paused"
    assert service.messages_of(paused) == 0
    assert service.act(paused, "resume")["status"] == "queued"
    assert service.act(kept, "cancel")["status"] == "cancelled"  # frees the resumed job's slot
    assert service.messages_of(paused) == 1  # sent anew
    assert len(service.waiting_messages()) == 1


@pytest.mark.parametrize("backend", ["postgres"])  # Redis, the broker that can go away
def test_a_cancel_succeeds_when_the_broker_is_unreachable(settings: Settings) -> None:
    port = free_port()
    proc = start_private_redis(port)
    settings.broker_url = f"redis://127.0.0.1:{port}/0"
    try:
        with running(settings) as service:
            job_id = service.create()
            assert service.messages_of(job_id) == 1
            proc.terminate()
            proc.wait(timeout=10)
            assert service.act(job_id, "cancel")["status"] == "cancelled"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
