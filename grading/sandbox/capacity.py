"""How many sandboxes one process may run at once, shared fairly between projects
(:class:`~grading.fair_slots.FairSlots`, named for sandboxes).

Every sandbox is a few processes of the sandbox user, and the host's process limit is shared
by all of them: before this existed, twenty slow graders of one tenant made the next ``bwrap``
fail to fork and every other tenant's grader answer 500. Now a sandbox runs only in a *slot*:

- ``total`` slots per process (an API process, a worker): ``GRPO_SANDBOX_MAX_SANDBOXES``;
- at most ``per_project`` of them held by one project's requests at once
  (``GRPO_SANDBOX_MAX_SANDBOXES_PER_PROJECT``), so one tenant never holds them all; a worker
  runs one job and takes slots with ``project=None`` (only the total applies);
- a request that finds no slot free waits, in arrival order among those a freed slot may go
  to, at most ``queue_timeout_s`` (``GRPO_SANDBOX_QUEUE_TIMEOUT_S``); the queue is bounded too:
  ``per_project`` waiting per project and ``total`` waiting in all. Beyond either bound, or past
  the wait, :class:`SandboxBusy` says which limit refused it and when to retry.

The bounds on waiting matter as much as the wait: an API request that waits here holds one of
its process's request slots (and a database connection), so running plus waiting stays within
``2 * total``; see docs/graders.md.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from grading.fair_slots import FairSlots, SlotNames
from grading.sandbox.errors import SandboxBusy
from grading.sandbox.settings import SandboxSettings

__all__ = ["SandboxCapacity", "process_capacity"]

PER_PROJECT_LIMIT = "GRPO_SANDBOX_MAX_SANDBOXES_PER_PROJECT"
TOTAL_LIMIT = "GRPO_SANDBOX_MAX_SANDBOXES"
SANDBOX_SLOTS = SlotNames(
    what="python graders",
    total=TOTAL_LIMIT,
    per_project=PER_PROJECT_LIMIT,
    queue_timeout="GRPO_SANDBOX_QUEUE_TIMEOUT_S",
)


@dataclass
class SandboxCapacity(FairSlots):
    """The sandbox slots of one process; refusals are :class:`SandboxBusy`."""

    names: SlotNames = SANDBOX_SLOTS

    @classmethod
    def from_settings(cls, settings: SandboxSettings) -> SandboxCapacity:
        return cls(
            total=settings.max_sandboxes,
            per_project=settings.max_sandboxes_per_project,
            queue_timeout_s=settings.queue_timeout_s,
            # About one call's time limit: the longest a request holds a started sandbox.
            retry_after_s=settings.call_timeout_s,
        )

    def refusal(
        self, message: str, *, limit: str, per_project: bool, retry_after_s: float
    ) -> SandboxBusy:
        return SandboxBusy(
            message, limit=limit, per_project=per_project, retry_after_s=retry_after_s
        )


_process_lock = threading.Lock()
_process: dict[tuple[int, int, float, float], SandboxCapacity] = {}


def process_capacity(settings: SandboxSettings) -> SandboxCapacity:
    """This process's slots, for pools not handed any (a worker's job). One per configuration:
    a process has one in production; tests build pools with settings of their own."""
    key = (
        settings.max_sandboxes,
        settings.max_sandboxes_per_project,
        settings.queue_timeout_s,
        settings.call_timeout_s,
    )
    with _process_lock:
        if key not in _process:
            _process[key] = SandboxCapacity.from_settings(settings)
        return _process[key]
