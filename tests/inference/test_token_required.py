"""Issue 32, section 4 (Low): `grpo inference` without GRPO_INFERENCE_TOKEN served its control
API and its engines to any local process, which could make any project's checkpoint servable.
It now refuses to start without one: it exits 2 saying which variable to set (16 characters
or more, the API's own bound, which the service's settings already enforce on a token that is
set), and nothing listens on its port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.inference.conftest import ROOT

pytestmark = [pytest.mark.process]


def _start(data_dir: Path) -> tuple[subprocess.CompletedProcess[str], int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")}
    env.update(
        PYTHONPATH=str(ROOT),
        GRPO_DATA_DIR=str(data_dir),
        GRPO_INFERENCE_SHARE_DEVICES="1",  # the device check must not be what refuses it
    )
    done = subprocess.run(
        [sys.executable, "-m", "grpo_cli", "inference", "--port", str(port)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, port


def _listens(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_grpo_inference_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    done, port = _start(tmp_path)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    [line] = done.stderr.strip().splitlines()  # one sentence, no traceback
    assert line.startswith("grpo inference: GRPO_INFERENCE_TOKEN "), line
    assert "16 characters or more" in line and "the API's GRPO_INFERENCE_TOKEN" in line, line
    assert "Inference control API on" not in done.stdout  # it never started serving
    assert not _listens(port)
