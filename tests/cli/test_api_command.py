"""`grpo api`: the production entry runs several API processes; the count comes from
--workers, else GRPO_API_WORKERS, else 2 per core (at most 4), and a bad count is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from grpo_cli.api import MAX_API_WORKERS, default_workers, resolve_workers
from tests.cli.helpers import cli
from tests.conftest import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_the_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_API_WORKERS", "3")
    assert resolve_workers(None) == 3
    assert resolve_workers(5) == 5


def test_the_default_is_two_per_core_and_at_most_four(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_API_WORKERS", raising=False)
    assert resolve_workers(None) == default_workers()
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert default_workers() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert default_workers() == 4


@pytest.mark.parametrize("value", ["0", "-1", "two", str(MAX_API_WORKERS + 1)])
def test_a_bad_count_is_refused_naming_its_source(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("GRPO_API_WORKERS", value)
    result = cli("api")
    assert result.code == 2
    assert "GRPO_API_WORKERS" in result.err
    monkeypatch.delenv("GRPO_API_WORKERS")
    result = cli("api", "--workers", "0")
    assert result.code == 2 and "--workers" in result.err


@pytest.mark.process
def test_grpo_api_serves_from_several_processes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")}
    env["GRPO_DATA_DIR"] = str(tmp_path)
    grpo = [sys.executable, "-m", "grpo_cli"]
    subprocess.run([*grpo, "db", "upgrade"], cwd=ROOT, env=env, check=True, timeout=120)
    port = free_port()
    server = subprocess.Popen(
        [*grpo, "api", "--port", str(port), "--workers", "2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def serving_processes() -> int:
        """uvicorn's worker processes: spawned children (its resource tracker aside)."""
        children = psutil.Process(server.pid).children()
        return sum(1 for c in children if "spawn_main" in " ".join(c.cmdline()))

    try:
        wait_until(healthy, 60, "grpo api to answer /healthz")
        wait_until(lambda: serving_processes() == 2, 30, "two API worker processes")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert server.returncode == 0  # a clean shutdown of every process on SIGTERM
