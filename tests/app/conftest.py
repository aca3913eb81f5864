"""Fixtures of the API tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from fastapi.testclient import TestClient

from app.core.settings import build_settings
from app.main import create_app
from tests.app.fuzz_target import Target
from tests.cli.conftest import ServerProcess
from tests.conftest import (
    REDIS_URL,
    Api,
    free_port,
    new_project_key,
    settings_for,
    wait_until,
)


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


@pytest.fixture(scope="module")
def fuzz_target(pg_url: str, sqlite_dir: Path, queue_name: str) -> Iterator[Target]:
    """The app on Postgres for the header and upload fuzz tests, with fair-use limits high
    enough that the fuzzer explores the API, not the 429 path."""
    cfg = settings_for(
        "postgres",
        pg_url,
        sqlite_dir,
        queue_name,
        max_body_bytes=64 * 1024,
        rate_limit_per_minute=1_000_000,
        rate_limit_burst=100_000,
        max_active_jobs_per_project=100_000,
        max_active_devices_per_project=1_000_000,
        max_streams_per_key=1000,
    )
    key, _ = new_project_key(cfg)
    target = Target(create_app(cfg), key)
    with target.client:
        yield target


@dataclass
class ApiProcesses:
    """The production API, `grpo api --workers 2`, as a subprocess on this session's Postgres:
    requests spread over its two serving processes, whose memory tests read."""

    server: ServerProcess
    headers: dict[str, str]

    @property
    def url(self) -> str:
        return self.server.url

    def serving_pids(self) -> list[int]:
        assert self.server.proc is not None
        children = psutil.Process(self.server.proc.pid).children()
        # uvicorn spawns its workers with multiprocessing (a resource tracker may sit beside).
        return [c.pid for c in children if "spawn_main" in " ".join(c.cmdline())]

    def peak_rss_bytes(self, reset: bool = False) -> dict[int, int]:
        """Each serving process's peak resident memory (the kernel's VmHWM); with ``reset``,
        the peak is first set back to what each holds now (clear_refs 5), so an earlier
        test's spike cannot hide this one's."""
        pids = self.serving_pids()
        if reset:
            for pid in pids:
                Path(f"/proc/{pid}/clear_refs").write_text("5")
        return {pid: _vm_hwm(pid) for pid in pids}

    def log(self) -> str:
        return self.server.log_path.read_text(errors="replace")


def _vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


@pytest.fixture(scope="module")
def api_processes(
    pg_url: str, queue_name: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ApiProcesses]:
    tmp = tmp_path_factory.mktemp("api-processes")
    settings = build_settings(
        data_dir=tmp / "data", database_url=pg_url, broker_url=REDIS_URL, queue_name=queue_name
    )
    key, _ = new_project_key(settings)
    server = ServerProcess(
        settings, free_port(), tmp / "api.log", command=("api", "--workers", "2")
    )
    server.start()
    try:
        processes = ApiProcesses(server, {"Authorization": f"Bearer {key}"})
        wait_until(lambda: len(processes.serving_pids()) >= 2, 60, "two API processes")
        yield processes
    finally:
        server.stop()
