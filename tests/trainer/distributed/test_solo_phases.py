"""Rank 0's solo phases on several ranks (issue 45): rank 0 alone starts the async rollout
server, takes a step's rollouts, evaluates and settles before a checkpoint, while the others
wait. They used to wait inside the next collective, bounded by GRPO_DIST_TIMEOUT_S, so a phase
longer than the timeout killed a healthy job. Two real processes in a gloo group: a phase
three times the timeout passes when the others watch rank 0's heartbeat
(``World.main_alone``), and fails in the plain broadcast; a rank 0 frozen (SIGSTOP, a machine
gone quiet) is still caught within the timeout, naming the phase; a rank 0 that fails in the
phase ends the others with that phase."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.conftest import wait_until

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 2.0


@pytest.fixture
def store_port() -> Iterator[int]:
    """The job's store, served by the test as torchrun's agent serves it: not by a rank."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


def start(out: Path, port: int, *, work_s: float, mode: str) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(port), str(TIMEOUT_S), str(work_s), str(out), mode]
    script = str(HERE / "solo_job.py")
    return [subprocess.Popen([sys.executable, script, str(r), *args], env=env) for r in (0, 1)]


def result(out: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads((out / f"rank{rank}.json").read_text()))


def finish(procs: list[subprocess.Popen[bytes]], timeout: float = 60.0) -> None:
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_solo_phase_three_times_the_timeout_passes_on_the_heartbeat(
    tmp_path: Path, store_port: int
) -> None:
    finish(start(tmp_path, store_port, work_s=3 * TIMEOUT_S, mode="solo"))
    expected = {"got": {"batch": [1, 2, 3], "version": 4}}
    assert result(tmp_path, 0) == expected and result(tmp_path, 1) == expected


def test_the_same_phase_in_a_plain_broadcast_times_out(tmp_path: Path, store_port: int) -> None:
    """What the job did before: the waiting rank's broadcast gives up at the world's timeout."""
    finish(start(tmp_path, store_port, work_s=3 * TIMEOUT_S, mode="plain"))
    waited = result(tmp_path, 1)
    assert waited["phase"] == "collect" and "got" not in waited


def test_a_frozen_rank_0_is_caught_within_the_timeout_naming_the_phase(
    tmp_path: Path, store_port: int
) -> None:
    procs = start(tmp_path, store_port, work_s=120.0, mode="solo")
    try:
        wait_until(lambda: (tmp_path / "working").exists(), 60, "rank 0 at work")
        os.kill(procs[0].pid, signal.SIGSTOP)  # the machine goes quiet: no crash, no beat
        stopped = time.monotonic()
        procs[1].wait(timeout=60)
        caught_after = time.monotonic() - stopped
        waited = result(tmp_path, 1)
        assert waited["phase"] == "collect"
        assert "rank 0 gave no sign of life for 2s" in waited["error"]
        assert caught_after < 30  # the world's timeout (2 s) and a beat or two, not 120 s
    finally:
        procs[0].kill()
        finish(procs)


@pytest.mark.parametrize("work_s", [0.0, 1.5 * TIMEOUT_S])
def test_a_rank_0_that_fails_in_the_phase_ends_the_others_naming_it(
    tmp_path: Path, store_port: int, work_s: float
) -> None:
    finish(start(tmp_path, store_port, work_s=work_s, mode="raise"))
    assert result(tmp_path, 0) == {"error": "rank 0's rollouts failed", "phase": "collect"}
    waited = result(tmp_path, 1)
    assert waited["phase"] == "collect" and "rank 0 failed in this phase" in waited["error"]
