"""A real service for the CLI tests: `grpo serve --no-worker` as a subprocess on a free port
(on this session's Postgres database and a Redis queue of its own) and one real `grpo worker`
process. Session-scoped: starting a worker imports torch, so every CLI test shares one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from app.core.settings import Settings, build_settings
from tests.conftest import REDIS_URL, free_port, new_project_key, tiny_spec, wait_until
from tests.worker.conftest import ROOT, WorkerProcess


class ServerProcess:
    """`grpo serve --no-worker --no-inference` (or another API command, such as the production `grpo api
    --workers 2`); kill() drops every open connection like a crashed server."""

    def __init__(
        self,
        settings: Settings,
        port: int,
        log_path: Path,
        command: tuple[str, ...] = ("serve", "--no-worker", "--no-inference"),
    ) -> None:
        self.settings = settings
        self.command = command
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def _spawn(self) -> subprocess.Popen[bytes]:
        env = os.environ.copy()
        env.update(
            GRPO_DATA_DIR=str(self.settings.data_dir),
            GRPO_DATABASE_URL=self.settings.resolved_database_url,
            GRPO_BROKER_URL=self.settings.resolved_broker_url,
            GRPO_QUEUE_NAME=self.settings.queue_name,
            GRPO_SSE_POLL_SECONDS="0.5",
        )
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "grpo_cli",
                    *self.command,
                    "--port",
                    str(self.port),
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def start(self, timeout: float = 90) -> None:
        """Start and wait for /readyz. On a loaded 2-core machine `grpo serve` can miss its 2 s
        database connect timeout while migrating; a start that exits early is tried again."""
        self.proc = self._spawn()

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                self.proc = self._spawn()
            try:
                return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_until(ready, timeout, "grpo serve to answer /readyz", interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.log()}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@dataclass
class CliService:
    server: ServerProcess
    worker: WorkerProcess
    key: str
    tmp: Path

    @property
    def url(self) -> str:
        return self.server.url

    def spec_file(self, name: str, steps: int = 2, **grpo: object) -> Path:
        """A tiny job (tiny random Llama, transformers rollouts, group 2, 8 new tokens)."""
        spec = tiny_spec(steps=steps, **grpo)
        spec["name"] = name
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        return path

    def logs(self) -> str:
        return f"server:\n{self.server.log()}\nworker:\n{self.worker.log_tail()}"


@pytest.fixture(scope="session")
def cli_service(
    pg_url: str, queue_name: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CliService]:
    tmp = tmp_path_factory.mktemp("cli")
    settings = build_settings(
        data_dir=tmp / "data",
        database_url=pg_url,
        broker_url=REDIS_URL,
        queue_name=f"{queue_name}-cli",
        heartbeat_seconds=1,
    )
    key, _ = new_project_key(settings)
    server = ServerProcess(settings, free_port(), tmp / "server.log")
    worker = WorkerProcess(settings, tmp / "worker.log")
    try:
        server.start()
        yield CliService(server, worker, key, tmp)
    finally:
        server.stop()
        worker.stop(signal.SIGKILL)


@pytest.fixture
def cli_env(cli_service: CliService, monkeypatch: pytest.MonkeyPatch) -> CliService:
    """Point the CLI at the test service through the environment, as CI would."""
    monkeypatch.setenv("GRPO_API_URL", cli_service.url)
    monkeypatch.setenv("GRPO_API_KEY", cli_service.key)
    for name in ("GITHUB_SHA", "CI_COMMIT_SHA"):
        monkeypatch.delenv(name, raising=False)
    return cli_service
