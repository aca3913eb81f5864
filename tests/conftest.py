"""Shared fixtures: real Postgres + Redis, and the embedded default (SQLite + filesystem broker).

Every test session gets its own Postgres database and Redis queue name, so parallel sessions on
one machine never see each other's rows or messages. Tests isolate themselves further by
creating their own project (and key) instead of truncating tables.

Tiers (markers registered in pyproject.toml, selections in the Makefile):
- `make test` (what CI runs): everything but `slow`: the fast tier below on every core, then the
  rest one test at a time.
- `make test-fast`: also leaves out `process` (real `grpo worker` / `grpo serve` processes),
  `model` (vLLM or the training loop on a model) and `browser`.
A test gets `process` from the fixtures it uses (PROCESS_FIXTURES below), so a new test that
starts a worker lands in the full tier without a mark of its own. `model` is set per module
with `pytestmark` or, for the trainer tests, in tests/trainer/conftest.py.
"""

from __future__ import annotations

import os

# One torch/OpenMP thread per process in the suite: tests run API, workers and trainers side by
# side on few cores, where spinning OpenMP threads made steps ~50x slower. Set before any torch
# import (worker subprocesses inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.core.db import make_engine, make_session_factory, session_scope
from app.core.settings import Settings, build_settings
from app.jobs import slots_repository as slots_repo
from app.main import create_app
from app.sessions.service import create_key
from grpo_cli import db as migrations

PG_ADMIN = os.environ.get("GRPO_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("GRPO_TEST_REDIS", "redis://127.0.0.1:6379/11")
BACKENDS = ("postgres", "sqlite")


# Fixtures that start real service processes: every test using one (directly or through another
# fixture) is marked `process`. `mlflow_url` starts an MLflow tracking server
# (tests/worker/test_trackers_mlflow.py); `api_processes` the production `grpo api`
# (tests/app/conftest.py).
PROCESS_FIXTURES = frozenset({"start_worker", "cli_service", "mlflow_url", "api_processes"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.process)


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.25
) -> object:
    """Poll `predicate` until it returns something truthy and return that; fail the test naming
    `what` once `timeout` seconds have passed. Tests wait on a condition, never sleep-then-assert.
    The predicate is always tried once more at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_private_redis(
    port: int, data_dir: Path | None = None, timeout: float = 10.0
) -> subprocess.Popen[bytes]:
    """A redis-server of the test's own, so a test can stop it without disturbing the shared
    one. With `data_dir` it keeps an append-only file there (it survives its own restart).
    Returns once it answers PING."""
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    if data_dir is None:
        args += ["--appendonly", "no"]
    else:
        args += ["--dir", str(data_dir), "--appendonly", "yes"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)

    def answers() -> bool:
        try:
            return bool(redis.Redis(port=port, socket_connect_timeout=0.5).ping())
        except redis.RedisError:
            return False

    try:
        wait_until(answers, timeout, f"redis-server on port {port} to answer PING", 0.1)
    except AssertionError:
        proc.kill()
        proc.wait()
        raise
    return proc


def _pg_url(dbname: str) -> str:
    base = PG_ADMIN.rsplit("/", 1)[0]
    return f"{base}/{dbname}".replace("postgresql://", "postgresql+psycopg://", 1)


def create_pg_database(prefix: str = "grpo_test") -> tuple[str, str]:
    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name, _pg_url(name)


def drop_pg_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    name, url = create_pg_database()
    migrations.upgrade(url)
    yield url
    drop_pg_database(name)


@pytest.fixture(scope="session")
def sqlite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("embedded")
    migrations.upgrade(f"sqlite:///{folder / 'grpo.db'}")
    return folder


@pytest.fixture(scope="session")
def queue_name() -> str:
    return f"grpo-test-{os.getpid()}-{secrets.token_hex(3)}"


def settings_for(
    backend: str, pg_url: str, sqlite_dir: Path, queue_name: str, **extra: object
) -> Settings:
    if backend == "postgres":
        return build_settings(
            data_dir=sqlite_dir / "pg-data",
            database_url=pg_url,
            broker_url=REDIS_URL,
            queue_name=queue_name,
            **extra,
        )
    return build_settings(data_dir=sqlite_dir, queue_name=queue_name, **extra)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def settings(
    backend: str, request: pytest.FixtureRequest, sqlite_dir: Path, queue_name: str
) -> Settings:
    url = request.getfixturevalue("pg_url") if backend == "postgres" else ""
    return settings_for(backend, url, sqlite_dir, queue_name, max_body_bytes=256 * 1024)


@dataclass
class Api:
    client: TestClient
    settings: Settings
    key: str
    project_id: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def new_key(self, project: str | None = None) -> tuple[str, str]:
        return new_project_key(self.settings, project)


def new_project_key(settings: Settings, project: str | None = None) -> tuple[str, str]:
    engine = make_engine(settings.resolved_database_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            created = create_key(session, project or f"p-{secrets.token_hex(4)}")
    finally:
        engine.dispose()
    return created.plaintext, created.project_id


@pytest.fixture
def api(settings: Settings) -> Iterator[Api]:
    key, project_id = new_project_key(settings)
    with TestClient(create_app(settings)) as client:
        yield Api(client, settings, key, project_id)


def tiny_spec(**grpo: object) -> dict[str, object]:
    """A small valid job spec (tiny model, generated arithmetic prompts)."""
    return {
        "model": "tiny-random-llama",
        "dataset": {"generator": {"type": "arithmetic", "count": 16}},
        "graders": [{"type": "numeric_match"}],
        "grpo": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8, **grpo},
        "rollout": {"engine": "transformers"},
    }


@dataclass
class RecordingDispatcher:
    """A broker stand-in that records every send: the job id, its queue, and (with `sessions`)
    what another connection sees at that moment: the job's committed status and how many jobs
    of its project hold a dispatch slot (a send must follow the commit that queued the job)."""

    sessions: sessionmaker[Session] | None = None
    sent: list[str] = field(default_factory=list)
    queues: dict[str, str | None] = field(default_factory=dict)
    committed_status: dict[str, str | None] = field(default_factory=dict)
    held_at_send: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, job_id: str, queue: str | None = None) -> bool:
        status: str | None = None
        held = -1
        if self.sessions is not None:
            with session_scope(self.sessions) as session:
                row = slots_repo.dispatch_row(session, job_id=job_id)
                if row is not None:
                    status = row.status
                    held = slots_repo.count_dispatched(session, project_id=row.project_id)
        with self.lock:
            self.sent.append(job_id)
            self.queues[job_id] = queue
            self.committed_status[job_id] = status
            self.held_at_send.append(held)
        return True
