"""What the launcher's tests share: a recording Callbacks, and looking for processes."""

from __future__ import annotations

import os
from pathlib import Path

from trainer.run.callbacks import Callbacks, RolloutSample, RunInfo
from trainer.run.rank_main import pid_file


class Recorder(Callbacks):
    """Records every hook; ``should_stop`` says True once ``stop_after`` steps were seen."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.stop_after = stop_after

    def on_start(self, info: RunInfo) -> None:
        self.calls.append(("start", info))

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        self.calls.append(("step", step, metrics))

    def on_event(
        self, kind: str, message: str, level: str = "info", data: dict[str, object] | None = None
    ) -> None:
        self.calls.append(("event", kind, message, level, data))

    def on_samples(self, step: int, samples: list[RolloutSample]) -> None:
        self.calls.append(("samples", step, samples))

    def on_checkpoint(self, step: int, path: Path) -> None:
        self.calls.append(("checkpoint", step, path))

    def should_stop(self) -> bool:
        self.calls.append(("should_stop",))
        return self.stop_after is not None and len(self.of("step")) >= self.stop_after

    def of(self, kind: str) -> list[tuple[object, ...]]:
        return [call for call in self.calls if call[0] == kind]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def rank_pids(output_dir: Path, nproc: int) -> list[int]:
    """The pids the ranks of a launch into ``output_dir`` wrote (those written so far)."""
    files = [pid_file(output_dir, rank) for rank in range(nproc)]
    return [int(f.read_text()) for f in files if f.is_file()]


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (a launch's output folder names the
    agent and every rank of it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline and alive(int(entry.name)):
            found.append(int(entry.name))
    return found
