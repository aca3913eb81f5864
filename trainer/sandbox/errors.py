"""Why a python grader could not run: errors of the sandbox, not of the grader's code."""

from __future__ import annotations

__all__ = ["SandboxBusy", "SandboxError"]


class SandboxError(RuntimeError):
    """The sandbox cannot run at all here (no bubblewrap, no interpreter, disabled), or the
    grader's source does not load."""


class SandboxBusy(SandboxError):
    """No sandbox for now: every slot it may take is held (``trainer.sandbox.capacity``), or the
    host refused the processes a sandbox needs. ``limit`` names the setting that refused it;
    ``per_project`` says whether it is the caller's own project's cap (the API answers 429)
    or the process's or host's (503); ``retry_after_s`` is when to try again."""

    def __init__(
        self, message: str, *, limit: str, per_project: bool, retry_after_s: float
    ) -> None:
        super().__init__(message)
        self.limit = limit
        self.per_project = per_project
        self.retry_after_s = retry_after_s
