"""GET /v1/stream: a project's change stream over real HTTP (uvicorn on a free port): a `jobs`
message on connecting and after each change of one of the project's jobs, none for another
project's, and the per-key stream cap applies."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.core.settings import Settings
from tests.conftest import settings_for, tiny_spec
from tests.live_server import Server, serve


class Parked:
    def send(self, job_id: str, queue: str | None = None) -> bool:
        return True


@pytest.fixture
def server(pg_url: str, sqlite_dir: Any, queue_name: str) -> Iterator[Server]:
    settings: Settings = settings_for(
        "postgres", pg_url, sqlite_dir, queue_name, sse_poll_seconds=0.2, max_streams_per_key=1
    )
    with serve(settings, Parked()) as live:
        yield live


def _messages(url: str, headers: dict[str, str], out: queue.Queue[Any]) -> None:
    """Put the status, then each `jobs` message's data; ends quietly when the server stops
    (the test reads the queue: nothing is asserted in this thread)."""
    try:
        with httpx.stream("GET", url, headers=headers, timeout=30) as response:
            out.put(response.status_code)
            name = None
            for line in response.iter_lines():
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: ") and name == "jobs":
                    out.put(json.loads(line.removeprefix("data: ")))
    except httpx.HTTPError as exc:
        out.put(exc)


def test_the_project_stream_tells_of_its_own_jobs_changes(server: Server) -> None:
    mine, theirs = server.key(), server.key()
    got: queue.Queue[Any] = queue.Queue()
    reader = threading.Thread(
        target=_messages, args=(f"{server.url}/v1/stream", mine, got), daemon=True
    )
    reader.start()
    assert got.get(timeout=20) == 200
    assert got.get(timeout=20)["jobs"] == 0  # on connecting
    # Another project's job: nothing for us (the next message must be about our own job).
    assert httpx.post(f"{server.url}/v1/jobs", json=tiny_spec(), headers=theirs).status_code == 201
    assert httpx.post(f"{server.url}/v1/jobs", json=tiny_spec(), headers=mine).status_code == 201
    assert got.get(timeout=20)["jobs"] == 1
    # The key's one stream is taken: a second is a 429 with Retry-After.
    second = httpx.get(f"{server.url}/v1/stream", headers=mine, timeout=10)
    assert second.status_code == 429 and second.headers["Retry-After"]
