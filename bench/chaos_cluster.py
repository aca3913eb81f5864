"""The chaos run's deployment, all of its own: a private Postgres cluster and redis-server that
can be crashed and restarted, the API (`grpo api`, several processes) and `grpo worker`
processes, each restartable, with the short lease settings that make faults resolve in seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

from app.core.job_status import LEASE_HOLDING_STATES
from bench.services import (
    PrivatePostgres,
    Process,
    Redis,
    create_project_key,
    free_port,
    service_env,
    sqlalchemy_url,
    start_api,
)

# Faults must resolve in seconds, not minutes: a lost worker's job is re-queued 6 s after its
# last heartbeat, a message the broker lost is re-sent after 8 s. `max_attempts` is high because
# the run kills workers on purpose far more often than production would: a job running out of
# attempts would be the chaos budget speaking, not a bug. Fair-use limits are raised so that
# they never refuse the run's own polling; the per-project dispatch cap keeps its default, so
# fair dispatch is exercised too.
SETTINGS: dict[str, Any] = {
    "lease_seconds": 6,
    "heartbeat_seconds": 1,
    "maintenance_seconds": 2,
    "redispatch_seconds": 8,
    "max_attempts": 100,
    "db_retry_seconds": 120,
    "stop_grace_seconds": 30,
    "rate_limit_per_minute": 100_000,
    "rate_limit_burst": 10_000,
    "max_active_jobs_per_project": 1_000,
    "max_active_devices_per_project": 1_000,
}


class Cluster:
    def __init__(self, folder: Path, workers: int = 3, api_workers: int = 2) -> None:
        self.folder = folder
        self.data = folder / "data"
        self.pg = PrivatePostgres(folder / "pg", free_port())
        self.redis = Redis(free_port(), data_dir=folder / "redis")
        self.api_port = free_port()
        self.api_workers = api_workers
        self.api: Process | None = None
        self.workers: list[Process | None] = [None] * workers
        self.generation = [0] * workers  # restarts of each worker slot
        self.database_url = ""

    # ---- start and stop --------------------------------------------------------------------

    def start(self) -> None:
        import psycopg

        from grpo_cli import db as migrations

        self.data.mkdir(parents=True, exist_ok=True)
        self.pg.init()
        self.pg.start()
        with psycopg.connect(self.pg.admin_url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE grpo")
        self.database_url = sqlalchemy_url(self.pg.admin_url.rsplit("/", 1)[0] + "/grpo")
        migrations.upgrade(self.database_url)
        self.redis.start()
        self.api = start_api(
            self.env(), self.api_port, self.api_workers, self.folder / "api.log", access_log=False
        )
        for slot in range(len(self.workers)):
            self.start_worker(slot)

    def env(self, **extra: Any) -> dict[str, str]:
        return service_env(
            self.database_url, self.redis.url, "grpo-chaos", self.data, **SETTINGS, **extra
        )

    def new_key(self, project: str) -> str:
        return create_project_key(self.database_url, project)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def worker_name(self, slot: int) -> str:
        return f"chaos-w{slot}-g{self.generation[slot]}"

    def start_worker(self, slot: int) -> None:
        self.generation[slot] += 1
        name = self.worker_name(slot)
        worker = Process(["worker"], self.env(worker_name=name), self.folder / f"worker-{name}.log")
        worker.start()
        self.workers[slot] = worker

    def ensure_up(self) -> None:
        """Every server running again (after the fault window, before the drain)."""
        if self.redis.proc is None or self.redis.proc.poll() is not None:
            self.redis.start()
        with contextlib.suppress(Exception):
            self.pg.start()  # fails when it is already running
        for slot, worker in enumerate(self.workers):
            if worker is not None and worker.alive():
                os.killpg(worker.pid, signal.SIGCONT)
            else:
                self.start_worker(slot)

    def stop(self) -> None:
        for worker in self.workers:
            if worker is not None:
                worker.stop(signal.SIGTERM, timeout=20)
        if self.api is not None:
            self.api.stop(signal.SIGTERM, timeout=20)
        self.redis.stop()

    def destroy(self) -> None:
        self.stop()
        self.pg.destroy()

    # ---- what the database says --------------------------------------------------------------

    def rows(self, query: str) -> list[dict[str, Any]]:
        import psycopg
        from psycopg.rows import dict_row

        url = self.pg.admin_url.rsplit("/", 1)[0] + "/grpo"
        with psycopg.connect(url, row_factory=dict_row, connect_timeout=5) as conn:
            return list(conn.execute(query).fetchall())  # type: ignore[arg-type]

    def lease_holders(self) -> dict[str, str]:
        """Worker name -> the job it holds a lease on (running, cancelling or pausing)."""
        states = ", ".join(f"'{s}'" for s in LEASE_HOLDING_STATES)  # constants, not user input
        rows = self.rows(
            f"SELECT id, lease_owner FROM jobs WHERE status IN ({states}) "
            "AND lease_owner IS NOT NULL"
        )
        return {str(r["lease_owner"]): str(r["id"]) for r in rows}
