"""Sandboxed execution of user Python (the ``python`` grader): bubblewrap + rlimits.

See :mod:`grading.sandbox.pool` for what is isolated and how, and docs/graders.md for the
threat model."""

from grading.sandbox.capacity import SandboxCapacity, process_capacity
from grading.sandbox.errors import SandboxBusy, SandboxError
from grading.sandbox.pool import SandboxPool, SandboxVerdict
from grading.sandbox.settings import SandboxSettings, build_sandbox_settings

__all__ = [
    "SandboxBusy",
    "SandboxCapacity",
    "SandboxError",
    "SandboxPool",
    "SandboxSettings",
    "SandboxVerdict",
    "build_sandbox_settings",
    "process_capacity",
]
