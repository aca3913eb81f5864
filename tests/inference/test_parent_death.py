"""An inference process killed outright (SIGKILL: no handler runs) takes its engines with it:
the guard of each engine gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and ends the vLLM
server's whole process group, its engine-core process included."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.inference.conftest import answers, start_inference
from tests.processes import group_alive, process_table

pytestmark = [pytest.mark.process, pytest.mark.model]


def _engine_group(inference_pid: int) -> int:
    """The process group of the vLLM server: the child of the engine's guard, itself a child
    of the inference process (forked from its launcher thread)."""
    processes = process_table()
    guards = {row.pid for row in processes if row.parent == inference_pid}
    servers = [row.group for row in processes if row.parent in guards]
    assert servers, "no engine process under the inference process"
    return servers[0]


def test_killing_the_process_kills_its_engines(
    pg_url: str, checkpoint_store: Path, tmp_path: Path
) -> None:
    inference = start_inference(tmp_path, pg_url, checkpoint_store)
    try:
        ready = inference.ensure_ready()
        group = _engine_group(inference.proc.pid)
        assert group_alive(group) and answers(ready.base_url)
        inference.proc.send_signal(signal.SIGKILL)
        inference.proc.wait(timeout=30)
        wait_until(lambda: not group_alive(group), 60, "the engine's processes to end")
        assert not answers(ready.base_url)
    finally:
        inference.stop()
