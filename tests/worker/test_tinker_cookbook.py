"""tinker-cookbook's sl_loop and rl_loop (0.6.1, unchanged, in `.venv-cookbook`: made by
scripts/cookbook/setup.sh) against a live grpo-service on the embedded default's database
(SQLite) with a real worker, with configuration only, as docs/tinker-cookbook.md describes:
scripts/cookbook/make_datasets.py writes the local datasets and tokenizer folder, and
scripts/cookbook/run.sh runs both loops on tiny-random-llama under the cookbook's name
meta-llama/Llama-3.2-1B.

- sl_loop: every step is applied and the loss falls;
- rl_loop (loss importance_sampling): every step samples groups from fresh sampler weights and
  logs its reward (0 on tiny-random-llama, whose alphabet has no backslash or braces, so it can
  never write the graded \\boxed{} answer), then saves its final state and sampler weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import new_project_key, settings_for
from tests.live_server import Server, serve
from tests.worker.conftest import WorkerProcess

pytestmark = [pytest.mark.process, pytest.mark.model]

ROOT = Path(__file__).resolve().parents[2]
COOKBOOK_PYTHON = ROOT / ".venv-cookbook" / "bin" / "python"
SCRIPTS = ROOT / "scripts" / "cookbook"
# The cookbook picks a renderer from a table of the models it knows; the server trains its
# packaged models. The alias joins the two (docs/tinker-cookbook.md).
COOKBOOK_MODEL = "meta-llama/Llama-3.2-1B"
ALIASES = f"{COOKBOOK_MODEL}=tiny-random-llama"

if not COOKBOOK_PYTHON.exists():
    pytest.skip(".venv-cookbook is missing: run make setup", allow_module_level=True)


@pytest.fixture
def live(
    sqlite_dir: Path, queue_name: str, start_worker: Callable[..., WorkerProcess]
) -> Iterator[Server]:
    settings = settings_for(
        "sqlite", "", sqlite_dir, queue_name, tinker_session_ttl_s=30,
        tinker_model_aliases=ALIASES,
    )  # fmt: skip
    with serve(settings) as server:
        start_worker(settings)  # the client's row names the packaged model it trains
        yield server


@pytest.fixture
def cookbook_data(tmp_path: Path) -> Path:
    data = tmp_path / "cookbook"
    subprocess.run(
        [sys.executable, str(SCRIPTS / "make_datasets.py"), str(data),
         "--tokenizer", ALIASES, "--gsm8k", "16", "--no-robots", "64"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return data


def metrics(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


def test_the_cookbooks_sl_and_rl_loops_run_unchanged_against_the_service(
    live: Server, cookbook_data: Path, tmp_path: Path
) -> None:
    logs = tmp_path / "runs"
    env = {
        **os.environ,
        "TINKER_API_KEY": "tml-" + new_project_key(live.settings)[0],
        "TINKER_BASE_URL": live.url,
        "COOKBOOK_DATA": str(cookbook_data),
        "COOKBOOK_MODEL": COOKBOOK_MODEL,
        "COOKBOOK_LOGS": str(logs),
        "PYTHONPATH": "",
    }
    done = subprocess.run(
        ["bash", str(SCRIPTS / "run.sh"), "both"],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]

    sl = metrics(logs / "sl_loop")
    assert [row["step"] for row in sl] == list(range(8))  # 64 chats, batch_size 8
    assert all("optim/step:max" in row for row in sl)
    assert min(row["train_mean_nll"] for row in sl[-2:]) < 0.6 * sl[0]["train_mean_nll"], sl

    rl = metrics(logs / "rl_loop")
    assert [row["step"] for row in rl] == list(range(4))  # max_steps 4
    assert all(0.0 <= row["reward/total"] <= 1.0 for row in rl), rl

    for loop in ("sl_loop", "rl_loop"):
        final = json.loads((logs / loop / "checkpoints.jsonl").read_text().splitlines()[-1])
        assert final["name"] == "final"
        assert final["state_path"].startswith("tinker://")
        assert final["sampler_path"].endswith("/sampler_weights/final")
