"""Slots of a capacity one process shares between projects: a bound in all, a bound per
project, and a bounded, time-limited queue in arrival order.

Used for what one request or job may hold that every tenant of the process competes for:
python-grader sandboxes (grading.sandbox.capacity) and the decoding of uploaded datasets
(app.core.state). The rules:

- ``total`` slots per process; at most ``per_project`` of them held by one project at once, so
  one tenant never holds them all (``project=None``: only the total applies, as for a worker
  running one job);
- a caller that finds no slot free waits, in arrival order among those a freed slot may go to,
  at most ``queue_timeout_s``; the queue is bounded too: ``per_project`` waiting per project and
  ``total`` waiting in all. Beyond either bound, or past the wait, :class:`SlotsBusy` says which
  limit refused it (by the operator's setting) and when to retry.

The bounds on waiting matter as much as the wait: an API request that waits holds one of its
process's request threads, so running plus waiting stays within ``2 * total``.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["FairSlots", "SlotNames", "SlotsBusy"]


class SlotsBusy(RuntimeError):
    """No slot for now. ``limit`` names the setting that refused it; ``per_project`` says
    whether it is the caller's own project's cap (the API answers 429) or the process's (503);
    ``retry_after_s`` is when to try again."""

    def __init__(
        self, message: str, *, limit: str, per_project: bool, retry_after_s: float
    ) -> None:
        super().__init__(message)
        self.limit = limit
        self.per_project = per_project
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class SlotNames:
    """How refusals name what the slots are for and the settings that bound them."""

    what: str  # plural, e.g. "python graders"
    total: str
    per_project: str
    queue_timeout: str


@dataclass
class _Waiter:
    project: str | None
    slot: int | None = None


@dataclass
class FairSlots:
    """The slots of one process (see the module docstring). Thread-safe."""

    total: int
    per_project: int
    queue_timeout_s: float
    names: SlotNames
    # What a refusal asks the caller to wait: about the longest a slot is held.
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

    # ------------------------------------------------------------------ taking and giving

    def acquire(self, project: str | None, *, wait: bool = True) -> int | None:
        """A slot number for ``project`` (None: no per-project cap). Without ``wait``, None
        when none is free now; with it, SlotsBusy when none is within the queue's bounds and
        time limit."""
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
        """Whether every slot is held."""
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

    def _busy(self, project: str | None, *, waited: bool) -> SlotsBusy:
        """The refusal: the project's own cap when it holds it (a 429 for its requests), else
        this process's (a 503)."""
        own = project is not None and self._held[project] >= self.per_project
        names = self.names
        if own:
            limit, value = names.per_project, self.per_project
            what = f"this project already runs as many {names.what} as one project may here"
        else:
            limit, value = names.total, self.total
            what = f"this server already runs as many {names.what} as it may"
        when = (
            f"none finished within {self.queue_timeout_s:g} s ({names.queue_timeout})"
            if waited
            else "and as many wait already"
        )
        return self.refusal(
            f"{what} ({limit}={value}), {when}; retry later",
            limit=limit,
            per_project=own,
            retry_after_s=math.ceil(self.retry_after_s),
        )

    def refusal(
        self, message: str, *, limit: str, per_project: bool, retry_after_s: float
    ) -> SlotsBusy:
        """The error a refusal raises (a user of the slots may raise a subclass of its own)."""
        return SlotsBusy(message, limit=limit, per_project=per_project, retry_after_s=retry_after_s)
