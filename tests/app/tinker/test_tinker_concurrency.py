"""Concurrent Tinker calls against the real API over HTTP (uvicorn, one event loop), on the
embedded SQLite and on Postgres: every one is answered, none waits on another's commit.

tinker-cookbook's rl_loop sends a batch's `asample` calls at once. When the routes ran their
database work on the event loop, a write waiting for SQLite's one writer blocked the loop, and
with it the commit of the request holding the lock: "database is locked" after 30 s, heartbeats
missed, and the session expired (410) under the client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import new_project_key, settings_for
from tests.live_server import serve

CLIENTS = 8
ROUNDS = 4


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_concurrent_writes_are_all_answered(
    backend: str, request: pytest.FixtureRequest, sqlite_dir: Path, queue_name: str
) -> None:
    url = request.getfixturevalue("pg_url") if backend == "postgres" else ""
    settings = settings_for(backend, url, sqlite_dir, queue_name, rate_limit_burst=1000)
    key = "tml-" + new_project_key(settings)[0]
    headers = {"X-API-Key": key}
    with serve(settings) as server:

        def client(n: int) -> list[int]:
            statuses = []
            with httpx.Client(base_url=f"{server.url}/api/v1", headers=headers, timeout=60) as c:
                for _ in range(ROUNDS):
                    made = c.post(
                        "/create_session",
                        json={"tags": [f"c{n}"], "sdk_version": "0.38.0"},
                    )
                    statuses.append(made.status_code)
                    if made.status_code != 200:
                        continue
                    session_id = made.json()["session_id"]
                    beat = c.post("/session_heartbeat", json={"session_id": session_id})
                    statuses.append(beat.status_code)
                    done = c.post(
                        f"/sessions/{session_id}/finish", json={"reason": {"type": "success"}}
                    )
                    statuses.append(done.status_code)
            return statuses

        with ThreadPoolExecutor(CLIENTS) as pool:
            answered = [s for statuses in pool.map(client, range(CLIENTS)) for s in statuses]
    assert answered == [200] * (CLIENTS * ROUNDS * 3)
