"""A base model's resolution (``python -m inference.resolve``, which may build a packaged model
for minutes) ends as soon as the inference process that started it is gone, killed or not: it
ran on as an orphan after ``grpo serve`` stopped."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import wait_until
from tests.processes import running

pytestmark = [pytest.mark.process]

# The intermediate process stands for the inference process: it starts a child that watches
# it (as inference.resolve's main does) and would then sleep for two minutes, prints the child's
# pid, and waits to be killed.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import os, time\\n"
    "from inference.resolve import exit_when_orphaned\\n"
    "exit_when_orphaned(os.getppid(), interval_s=0.05)\\n"
    "print('watching', flush=True)\\n"
    "time.sleep(120)\\n"], stdout=subprocess.PIPE, text=True)
assert child.stdout is not None and child.stdout.readline().strip() == "watching"
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_resolution_ends_with_the_process_that_started_it() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert running({child}) == {child}
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        wait_until(lambda: not running({child}), 10, "the orphaned resolution to end")
    finally:
        parent.kill()
