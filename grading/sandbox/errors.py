"""Why a python grader could not run: errors of the sandbox, not of the grader's code."""

from __future__ import annotations

from grading.fair_slots import SlotsBusy

__all__ = ["SandboxBusy", "SandboxError"]


class SandboxError(RuntimeError):
    """The sandbox cannot run at all here (no bubblewrap, no interpreter, disabled), or the
    grader's source does not load."""


class SandboxBusy(SandboxError, SlotsBusy):
    """No sandbox for now: every slot it may take is held (``grading.sandbox.capacity``), or the
    host refused the processes a sandbox needs (``limit`` then names the host's process limit,
    and ``per_project`` is False: a 503)."""
