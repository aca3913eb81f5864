"""An idle Tinker client never pins the worker other tenants need (issue 44), on the
production shape: the official `tinker` SDK (0.38, unchanged, in `.venv-tinker`), the API
under uvicorn, Postgres, Redis, and one real `grpo worker` serving both jobs and Tinker
clients (the embedded default's split).

The SDK client trains, then goes quiet with gradients pending while its session heartbeats
(the SDK does that by itself, every 10 s). Another project's job, which waits for the one
worker, starts within one idle-release period; the client's next calls wait for the worker
(the job first), then continue with exactly the losses of a client that was never released.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.tinker_tables import TinkerModel
from tests.conftest import new_project_key, settings_for, wait_until
from tests.live_server import Server, serve
from tests.worker.conftest import WorkerProcess
from tests.worker.test_tinker_sdk import CLIENT, SDK_PYTHON, run_client

pytestmark = [pytest.mark.process, pytest.mark.model]

IDLE_RELEASE_S = 6


@pytest.fixture
def live(
    pg_url: str, sqlite_dir: Path, start_worker: Callable[..., WorkerProcess]
) -> Iterator[tuple[Server, WorkerProcess]]:
    settings = settings_for(
        "postgres", pg_url, sqlite_dir, f"grpo-share-{secrets.token_hex(4)}",
        tinker_session_ttl_s=30, tinker_idle_release_s=IDLE_RELEASE_S,
    )  # fmt: skip
    with serve(settings) as server:
        worker = start_worker(settings, GRPO_TINKER_IDLE_RELEASE_S=str(IDLE_RELEASE_S))
        yield server, worker


def model_status(server: Server, model_id: str) -> str | None:
    engine = make_engine(server.settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as db:
            row = db.get(TinkerModel, model_id)
            return row.status if row is not None else None
    finally:
        engine.dispose()


def job_status(server: Server, job_id: str, headers: dict[str, str]) -> str:
    answer = httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["status"])


def start_idle_client(server: Server, go_file: Path) -> tuple[subprocess.Popen[str], str]:
    """The SDK's `idle` scenario as a new project; the process and its model once quiet."""
    env = {
        **os.environ,
        "TINKER_API_KEY": "tml-" + new_project_key(server.settings)[0],
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": "",
    }
    process = subprocess.Popen(
        [str(SDK_PYTHON), str(CLIENT), server.url, "idle", str(go_file)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()  # blocks until the client has gone quiet (or died)
    if not line:
        process.wait(30)
        pytest.fail(f"the SDK client ended early: {process.stderr.read()[-4000:]}")  # type: ignore[union-attr]
    return process, str(json.loads(line)["ready"])


def test_an_idle_client_frees_the_worker_for_another_projects_job_then_continues_exactly(
    live: tuple[Server, WorkerProcess], tmp_path: Path
) -> None:
    server, worker = live
    go_now = tmp_path / "go-now"
    go_now.touch()
    straight: dict[str, Any] = run_client(server, "idle", str(go_now))  # never quiet

    go_later = tmp_path / "go-later"
    client, model_id = start_idle_client(server, go_later)
    try:
        # Another project's job, sent while the only worker holds the quiet client.
        headers = server.key()
        job_id = server.new_job(headers)
        started = wait_until(
            lambda: job_status(server, job_id, headers) != "queued",
            IDLE_RELEASE_S + 60,
            "the job to leave the queue while the Tinker client sits idle",
        )
        assert started
        assert model_status(server, model_id) == "released"  # written to disk, worker freed
        go_later.touch()  # its next calls: the model goes back to the queue
        out, err = client.communicate(timeout=420)
        assert client.returncode == 0, err[-4000:]
    finally:
        if client.poll() is None:
            client.kill()
    resumed = json.loads(out.strip().splitlines()[-1])
    assert resumed["losses"] == straight["losses"], (resumed, straight)
    assert "idle, released" in worker.log_tail(200_000)
    wait_until(lambda: job_status(server, job_id, headers) == "succeeded", 300, "the job to finish")
