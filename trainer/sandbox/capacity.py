"""How many sandboxes one process may run at once, shared fairly between projects.

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

import contextlib
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from trainer.sandbox.errors import SandboxBusy
from trainer.sandbox.settings import SandboxSettings

__all__ = ["SandboxCapacity", "process_capacity"]

PER_PROJECT_LIMIT = "GRPO_SANDBOX_MAX_SANDBOXES_PER_PROJECT"
TOTAL_LIMIT = "GRPO_SANDBOX_MAX_SANDBOXES"


@dataclass
class _Waiter:
    project: str | None
    slot: int | None = None


@dataclass
class SandboxCapacity:
    """The slots of one process (see the module docstring). Thread-safe."""

    total: int
    per_project: int
    queue_timeout_s: float
    # What a refusal asks the caller to wait: about one call's time limit, the longest a slot
    # is held by a request once its sandbox has started.
    retry_after_s: float = 5.0
    _lock: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _free: list[int] = field(default_factory=list, repr=False)
    _held: Counter[str | None] = field(default_factory=Counter, repr=False)
    _owner: dict[int, str | None] = field(default_factory=dict, repr=False)
    _queue: list[_Waiter] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not (self.total >= 1 and self.per_project >= 1 and self.queue_timeout_s >= 0):
            raise ValueError("total and per_project must be >= 1, queue_timeout_s >= 0")
        self._free = list(range(self.total - 1, -1, -1))

    @classmethod
    def from_settings(cls, settings: SandboxSettings) -> SandboxCapacity:
        return cls(
            total=settings.max_sandboxes,
            per_project=settings.max_sandboxes_per_project,
            queue_timeout_s=settings.queue_timeout_s,
            retry_after_s=settings.call_timeout_s,
        )

    # ------------------------------------------------------------------ taking and giving

    def acquire(self, project: str | None, *, wait: bool = True) -> int | None:
        """A slot number for one sandbox of ``project`` (None: no per-project cap). Without
        ``wait``, None when none is free now; with it, SandboxBusy when none is within the
        queue's bounds and time limit."""
        with self._lock:
            # Waiters left queued while a slot is free are all at their projects' caps
            # (_hand_out gave the others theirs): this request passes none of them.
            if self._may_take(project):
                return self._take(project)
            if not wait:
                return None
            self._refuse_unless_room_to_wait(project)
            waiter = _Waiter(project)
            self._queue.append(waiter)
            deadline = time.monotonic() + self.queue_timeout_s
            try:
                while waiter.slot is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise self._busy(project, waited=True)
                    self._lock.wait(remaining)
                return waiter.slot
            finally:
                if waiter in self._queue:
                    self._queue.remove(waiter)
                    self._hand_out()  # a waiter ahead that gave up may unblock those behind

    @contextlib.contextmanager
    def slot(self, project: str | None) -> Iterator[int]:
        """A slot held for the block (waiting for it as :meth:`acquire` does)."""
        slot = self.acquire(project)
        assert slot is not None  # a waiting acquire returns one or raises
        try:
            yield slot
        finally:
            self.release(slot)

    def release(self, slot: int) -> None:
        with self._lock:
            project = self._owner.pop(slot)
            self._held[project] -= 1
            self._free.append(slot)
            self._hand_out()

    def full(self) -> bool:
        """Whether every slot is held (a pool idle between batches then gives its slots back)."""
        with self._lock:
            return not self._free

    def held(self, project: str | None) -> int:
        with self._lock:
            return self._held[project]

    # ------------------------------------------------------------------ under the lock

    def _may_take(self, project: str | None) -> bool:
        return bool(self._free) and (project is None or self._held[project] < self.per_project)

    def _take(self, project: str | None) -> int:
        slot = self._free.pop()
        self._held[project] += 1
        self._owner[slot] = project
        return slot

    def _hand_out(self) -> None:
        """Give free slots to waiters in arrival order, skipping those whose project is at its
        cap (they do not block another project's waiter behind them)."""
        for waiter in list(self._queue):
            if not self._free:
                break
            if waiter.slot is None and self._may_take(waiter.project):
                waiter.slot = self._take(waiter.project)
                self._queue.remove(waiter)
        self._lock.notify_all()

    def _refuse_unless_room_to_wait(self, project: str | None) -> None:
        if project is not None:
            waiting = sum(w.project == project for w in self._queue)
            if waiting >= self.per_project:
                raise self._busy(project, waited=False)
        if len(self._queue) >= self.total:
            raise self._busy(None, waited=False)

    def _busy(self, project: str | None, *, waited: bool) -> SandboxBusy:
        """The refusal: the project's own cap when it holds it (a 429 for its requests), else
        this process's (a 503)."""
        own = project is not None and self._held[project] >= self.per_project
        if own:
            limit, value = PER_PROJECT_LIMIT, self.per_project
            what = "this project already runs as many python graders as one project may here"
        else:
            limit, value = TOTAL_LIMIT, self.total
            what = "this server already runs as many python graders as it may"
        when = (
            f"none finished within {self.queue_timeout_s:g} s (GRPO_SANDBOX_QUEUE_TIMEOUT_S)"
            if waited
            else "and as many wait already"
        )
        return SandboxBusy(
            f"{what} ({limit}={value}), {when}; retry later",
            limit=limit,
            per_project=own,
            retry_after_s=math.ceil(self.retry_after_s),
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
