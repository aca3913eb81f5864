"""Sandboxed execution of user Python (the ``python`` grader): bubblewrap + rlimits.

See :mod:`grading.sandbox.pool` for what is isolated and how, and docs/graders.md for the
threat model.

- ``pool``: a pool of sandboxed processes that run one user grader;
- ``command``: the bubblewrap command line, rlimits and user a sandbox starts with;
- ``seccomp``: the seccomp filter that refuses system calls a grader never needs;
- ``child_main``: the program a sandbox runs, and its line protocol;
- ``capacity``: how many sandboxes a process may run at once, shared fairly between projects;
- ``settings``: the operator's settings (``GRPO_SANDBOX_*``);
- ``errors``: why a grader could not run: errors of the sandbox, not of the grader's code.
"""

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
