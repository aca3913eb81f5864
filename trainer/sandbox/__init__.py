"""Sandboxed execution of user Python (the ``python`` grader): bubblewrap + rlimits.

See :mod:`trainer.sandbox.pool` for what is isolated and how, and docs/graders.md for the
threat model."""

from trainer.sandbox.capacity import SandboxCapacity, process_capacity
from trainer.sandbox.errors import SandboxBusy, SandboxError
from trainer.sandbox.pool import SandboxPool, SandboxVerdict
from trainer.sandbox.settings import SandboxSettings, build_sandbox_settings

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
