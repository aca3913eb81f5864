"""Worker fixtures: a real `grpo worker` process, and in-process worker contexts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    def __init__(self, settings: Settings, log_path: Path, **env: str) -> None:
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
            [sys.executable, "-m", "grpo_cli", "worker"],
            cwd=ROOT,
            env=environment,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(settings: Settings, **env: str) -> WorkerProcess:
        worker = WorkerProcess(settings, tmp_path / f"worker-{len(started)}.log", **env)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop(signal.SIGKILL)


def wait_for(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.25
) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
