"""The official `tinker` SDK (0.38.0, unchanged, in `.venv-tinker`: an environment without
torch) against a live grpo-service (uvicorn, Postgres, Redis, a real Celery worker holding the
training clients), through `tests/worker/tinker_client.py`:

- supervised: cross_entropy steps lower the loss; save_state, then a client restored from the
  state (with its optimizer) takes the same next step as the original, to float precision;
- reinforcement: sample groups from the saved weights, importance_sampling, optim_step, and
  the reward rises;
- bad calls: an unknown loss and an unknown base model are the SDK's own error classes with
  our messages.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import new_project_key, settings_for
from tests.live_server import Server, serve
from tests.worker.conftest import WorkerProcess

pytestmark = [pytest.mark.process, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
SDK_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
CLIENT = Path(__file__).with_name("tinker_client.py")

if not SDK_PYTHON.exists():  # made by `make setup` (scripts/setup.sh)
    pytest.skip(".venv-tinker is missing: run make setup", allow_module_level=True)


@pytest.fixture
def live(
    pg_url: str, sqlite_dir: Path, start_worker: Callable[..., WorkerProcess]
) -> Iterator[Server]:
    settings = settings_for(
        "postgres", pg_url, sqlite_dir, f"grpo-tinker-{secrets.token_hex(4)}",
        tinker_session_ttl_s=30,
    )  # fmt: skip
    with serve(settings) as server:
        start_worker(settings)
        yield server


def run_client(
    server: Server, scenario: str, *args: str, key: str | None = None, timeout: float = 420
) -> dict[str, Any]:
    """The scenario's JSON, run by the SDK as the project of ``key`` (the project's own key;
    default a new project's)."""
    key = "tml-" + (key or new_project_key(server.settings)[0])
    env = {
        **os.environ,
        "TINKER_API_KEY": key,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": "",
    }
    done = subprocess.run(
        [str(SDK_PYTHON), str(CLIENT), server.url, scenario, *args],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_supervised_loop_lowers_the_loss_and_resumes_exactly_from_its_state(
    live: Server,
) -> None:
    out = run_client(live, "sl")
    losses = out["losses"]
    assert losses[-1] < losses[0] * 0.8, losses
    assert out["state_path"].startswith("tinker://") and out["state_path"].endswith("/weights/mid")
    # The restored client (weights and Adam state) takes the same step as the original.
    assert out["restored"] == pytest.approx(out["straight"], rel=1e-5, abs=1e-6)
    assert "weights/mid" in out["checkpoints"]
    assert out["loss_sum"] > 0


def test_a_reinforcement_loop_raises_the_reward(live: Server) -> None:
    rewards = run_client(live, "rl")["rewards"]
    assert rewards[-1] > rewards[0] + 0.1, rewards


def test_bad_calls_are_the_sdks_own_errors_with_our_messages(live: Server) -> None:
    out = run_client(live, "errors")
    # Refused by the API before anything is stored (app.tinker.admission), not by the worker.
    name, status, message = out["unknown_loss"]
    assert (name, status) == ("BadRequestError", 400) and "no_such_loss" in message
    name, status, message = out["unknown_model"]
    assert (name, status) == ("BadRequestError", 400) and "base_model" in message
