"""An inference process killed outright (SIGKILL: no handler runs) takes its engines with it:
the guard of each engine gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and ends the vLLM
server's whole process group, its engine-core process included."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.serving.conftest import answers, start_inference

pytestmark = [pytest.mark.process, pytest.mark.model]


def _processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended while we looked
        found.append((int(stat.parent.name), fields[0], int(fields[1]), int(fields[2])))
    return found


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie waiting to be reaped is gone)."""
    return any(group == pgid and state != "Z" for _, state, _, group in _processes())


def _engine_group(inference_pid: int) -> int:
    """The process group of the vLLM server: the child of the engine's guard, itself a child
    of the inference process (forked from its launcher thread)."""
    processes = _processes()
    guards = {pid for pid, _, parent, _ in processes if parent == inference_pid}
    servers = [group for _, _, parent, group in processes if parent in guards]
    assert servers, "no engine process under the inference process"
    return servers[0]


def test_killing_the_process_kills_its_engines(
    pg_url: str, checkpoint_store: Path, tmp_path: Path
) -> None:
    inference = start_inference(tmp_path, pg_url, checkpoint_store)
    try:
        ready = inference.ensure_ready()
        group = _engine_group(inference.proc.pid)
        assert _group_alive(group) and answers(ready.base_url)
        inference.proc.send_signal(signal.SIGKILL)
        inference.proc.wait(timeout=30)
        wait_until(lambda: not _group_alive(group), 60, "the engine's processes to end")
        assert not answers(ready.base_url)
    finally:
        inference.stop()
