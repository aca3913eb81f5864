"""Worker fixtures: a real `grpo worker` process, and in-process worker contexts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.core.settings import Settings
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """`grpo worker` (``python -m grpo_cli worker``, or ``module``'s own `worker` command) with
    the test's settings and ``env``."""

    def __init__(
        self, settings: Settings, log_path: Path, *, module: str = "grpo_cli", **env: str
    ) -> None:
        self.log_path = log_path
        environment = os.environ.copy()
        environment.update(
            GRPO_DATA_DIR=str(settings.data_dir),
            GRPO_DATABASE_URL=settings.resolved_database_url,
            GRPO_BROKER_URL=settings.resolved_broker_url,
            GRPO_QUEUE_NAME=settings.queue_name,
            GRPO_HEARTBEAT_SECONDS="1",
            GRPO_MAINTENANCE_SECONDS="2",
            GRPO_LEASE_SECONDS=str(settings.lease_seconds),
            **env,
        )
        self._log = open(log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "worker"],
            cwd=ROOT,
            env=environment,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int | None:
        """Send `sig` and wait up to `timeout` seconds for the process to exit. Returns its exit
        status, or None when it did not exit in time (it is then killed)."""
        status = self.proc.poll()
        if status is None:
            self.proc.send_signal(sig)
            try:
                status = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return status


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(settings: Settings, *, module: str = "grpo_cli", **env: str) -> WorkerProcess:
        log = tmp_path / f"worker-{len(started)}.log"
        worker = WorkerProcess(settings, log, module=module, **env)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop(signal.SIGKILL)


# The shared helper under the name the worker tests use.
wait_for = wait_until
