"""The machine's process table, read from /proc, for tests that check which processes end with
which (a killed inference process and its engines, `grpo serve` and its children), and a vLLM
engine held still (:class:`HeldEngine`) for tests whose client must leave before the engine
finishes."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import NamedTuple


class ProcessRow(NamedTuple):
    pid: int
    state: str  # "Z": a zombie, ended and waiting for its parent to reap it
    parent: int
    group: int


def process_table() -> list[ProcessRow]:
    """Every process now, from /proc/<pid>/stat."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # it ended while we looked
        found.append(ProcessRow(int(stat.parent.name), fields[0], int(fields[1]), int(fields[2])))
    return found


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie waiting to be reaped is gone)."""
    return any(row.group == pgid and row.state != "Z" for row in process_table())


def running(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (zombies count as ended)."""
    return {row.pid for row in process_table() if row.pid in pids and row.state != "Z"}


def descendants(pid: int) -> set[int]:
    """The children of ``pid``, theirs, and so on, as the table stands now."""
    children: dict[int, list[int]] = {}
    for row in process_table():
        children.setdefault(row.parent, []).append(row.pid)
    found: set[int] = set()
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child not in found:
            found.add(child)
            todo.extend(children.get(child, []))
    return found


def model_runner(inference_pid: int) -> int:
    """The pid of the one vLLM model-runner process (``VLLM::Worker``) below the inference
    process: the process that computes every step, its engine-core process only schedules."""
    runners = []
    for pid in descendants(inference_pid):
        with contextlib.suppress(OSError):  # it ended while we looked
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::Worker"):
                runners.append(pid)
    assert len(runners) == 1, runners
    return runners[0]


class HeldEngine:
    """A vLLM model runner stopped (SIGSTOP) but for the short pulses the test gives it, so the
    engine generates only a token or so at a time. Unheld, the tiny model's engine generates a
    1000-token request in about a second while its OpenMP threads, pinned to their cores,
    starve everything there, its own API server included: on a quiet machine the whole request
    was done before the client read its first chunk. Held, the client surely leaves first. This
    process (and the threads it starts) keeps off the runner's cores meanwhile, so the runner's
    spinning threads cannot stretch a pulse."""

    PULSE_S = 0.0005

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.affinity = os.sched_getaffinity(0)

    def __enter__(self) -> HeldEngine:
        elsewhere = self.affinity - os.sched_getaffinity(self.pid)
        if elsewhere:
            os.sched_setaffinity(0, elsewhere)
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def pulse(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        time.sleep(self.PULSE_S)
        os.kill(self.pid, signal.SIGSTOP)

    def __exit__(self, *_: object) -> None:
        os.kill(self.pid, signal.SIGCONT)
        os.sched_setaffinity(0, self.affinity)
