"""One tracker export: a bounded in-memory queue and a background thread that sends batches.

The training thread only appends to the queue (:meth:`Exporter.add_step`, O(metrics) and never
blocking on the network), so a slow or unreachable tracker can neither fail nor slow the job.
The thread wakes every ``batch_seconds`` (or once a full batch is waiting, or when the job
ends), opens the tracker's run if it is not open yet, and sends the queue in batches. A batch
that fails is retried with exponential backoff for ``retry_seconds``; a tracker's permanent
refusal (:class:`PermanentError`) is not retried. A batch given up, and values the full queue
turned away, are counted as lost; :meth:`Exporter.take_report` hands the training thread what
was lost since the last report, for a job event.

:meth:`Exporter.close` sends the final tags and the run's end status, and waits at most its
``timeout``: whatever is still unsent then is lost (and reported), and the job ends anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

log = logging.getLogger(__name__)

# How a job attempt ended, as the trackers see it: "stopped" is a pause or a worker shutdown,
# after which the job resumes (the run is left open for the next attempt).
Outcome = Literal["succeeded", "failed", "cancelled", "stopped"]


@dataclass(frozen=True)
class Point:
    """One metric value of one step, as sent to a tracker."""

    step: int
    key: str
    value: float
    timestamp_ms: int


class PermanentError(Exception):
    """The tracker refused a request in a way a retry cannot fix (a 4xx other than 429)."""


class Tracker(Protocol):
    """A tracker's client, called only from its exporter's thread."""

    kind: str  # "mlflow", "wandb"
    where: str  # for people: "MLflow experiment 'x' at http://..."

    def open(self) -> None:
        """Create (or find again, for a resumed job) the run and log its params; idempotent."""

    def log_metrics(self, points: list[Point]) -> None:
        """Send one batch (at most the exporter's ``batch_size`` points)."""

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def finish(self, outcome: Outcome) -> None:
        """Mark the run ended (or leave it open for a resumed job, for "stopped")."""

    def close(self) -> None:
        """Release the client (after the last request, successful or not)."""


@dataclass
class Lost:
    """What an export gave up on: metric values (by step) and other parts (tags, the status)."""

    values: int = 0
    steps: set[int] = field(default_factory=set)
    parts: list[str] = field(default_factory=list)
    error: str | None = None

    def add(self, points: list[Point], error: str | None) -> None:
        self.values += len(points)
        self.steps.update(p.step for p in points)
        self.error = error or self.error

    def __bool__(self) -> bool:
        return bool(self.values or self.parts)


@dataclass(frozen=True)
class Report:
    """What an export did not deliver, for a job event."""

    kind: str
    message: str
    data: dict[str, object]


def describe(kind: str, where: str, lost: Lost) -> Report:
    what = []
    if lost.values:
        first, last = min(lost.steps), max(lost.steps)
        span = f"step {first}" if first == last else f"{len(lost.steps)} steps ({first}-{last})"
        what.append(f"{lost.values} metric values of {span}")
    what.extend(lost.parts)
    message = f"{where}: not exported: {', '.join(what)}"
    if lost.error:
        message += f" ({lost.error})"
    data: dict[str, object] = {
        "tracker": kind,
        "values": lost.values,
        "steps": len(lost.steps),
        "parts": list(lost.parts),
        "error": lost.error,
    }
    if lost.steps:
        data["first_step"], data["last_step"] = min(lost.steps), max(lost.steps)
    return Report(kind, message[:4000], data)


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


class Exporter:
    """Sends one tracker its run's metrics from a background thread (see the module doc)."""

    def __init__(
        self,
        tracker: Tracker,
        *,
        queue_size: int,
        batch_size: int = 1000,
        batch_seconds: float = 2.0,
        retry_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tracker = tracker
        self._queue_size = queue_size
        self._batch_size = batch_size
        self._batch_seconds = batch_seconds
        self._retry_seconds = retry_seconds
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: deque[Point] = deque()
        self._inflight: list[Point] = []
        self._lost = Lost()  # since the last report
        self._final: tuple[dict[str, str], Outcome] | None = None
        self._deadline: float | None = None  # set by close()
        self._done = False
        self._abandoned = False
        self._thread = threading.Thread(
            target=self._run, name=f"export-{tracker.kind}", daemon=True
        )
        self._thread.start()

    # -- the training thread ----------------------------------------------------------------

    def add_step(self, step: int, values: dict[str, float | None]) -> None:
        """Queue a step's finite values; never blocks on the tracker."""
        now = int(time.time() * 1000)
        points = [Point(step, k, float(v), now) for k, v in values.items() if v is not None]
        with self._cond:
            if self._final is not None:
                return
            if len(self._pending) + len(points) > self._queue_size:
                self._lost.add(points, "the export queue was full: the tracker is slow or down")
                return
            self._pending.extend(points)
            if len(self._pending) >= self._batch_size:
                self._cond.notify()

    def take_report(self) -> Report | None:
        """What was lost since the last report, or None."""
        with self._cond:
            lost, self._lost = self._lost, Lost()
        return describe(self.tracker.kind, self.tracker.where, lost) if lost else None

    def close(self, tags: dict[str, str], outcome: Outcome, timeout: float) -> Report | None:
        """Send what is queued, ``tags`` and the run's end; wait at most ``timeout`` seconds.
        Returns what was not exported (since the last report), or None."""
        self.request_close(tags, outcome, timeout)
        return self.wait_closed(timeout)

    def request_close(self, tags: dict[str, str], outcome: Outcome, timeout: float) -> None:
        """Tell the thread to send what is left, then ``tags`` and the end, within ``timeout``."""
        with self._cond:
            self._final = (tags, outcome)
            self._deadline = self._clock() + timeout
            self._cond.notify_all()

    def wait_closed(self, timeout: float) -> Report | None:
        """Wait for the thread at most ``timeout`` seconds (plus a little for its last step);
        what was not exported, everything still unsent included."""
        self._thread.join(max(0.0, timeout) + 0.5)
        with self._cond:
            if self._thread.is_alive():  # a request hangs past the deadline: leave it behind
                self._abandoned = True
                self._lost.add(self._inflight + list(self._pending), "the end-of-job wait ran out")
                self._pending.clear()
                if not self._done:
                    self._lost.parts.append("the final checkpoint and run status")
        return self.take_report()

    # -- the export thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._final is None and len(self._pending) < self._batch_size:
                    self._cond.wait(self._batch_seconds)
                if self._abandoned:
                    return
                if not self._pending and self._final is not None:
                    break
                batch = [
                    self._pending.popleft()
                    for _ in range(min(self._batch_size, len(self._pending)))
                ]
                self._inflight = batch
            if batch:
                self._deliver(batch)
        tags, outcome = self._final
        if tags and self._attempt(lambda: self.tracker.set_tags(tags)) is not None:
            self._lose_part("the final checkpoint reference")
        if self._attempt(lambda: self.tracker.finish(outcome)) is not None:
            self._lose_part("the run's end status")
        try:
            self.tracker.close()
        except Exception as exc:
            log.warning("%s: closing the client failed: %s", self.tracker.where, exc)
        with self._cond:
            self._done = True

    def _deliver(self, batch: list[Point]) -> None:
        error = self._attempt(lambda: self.tracker.log_metrics(batch))
        with self._cond:
            self._inflight = []
            if error is not None and not self._abandoned:
                self._lost.add(batch, error)

    def _lose_part(self, part: str) -> None:
        with self._cond:
            if not self._abandoned:
                self._lost.parts.append(part)

    def _attempt(self, request: Callable[[], None]) -> str | None:
        """Open the run if needed and run ``request``, retrying with backoff until the retry
        budget or the close deadline runs out. Returns None on success, else the last error."""
        give_up = self._clock() + self._retry_seconds
        backoff = 0.5
        while True:
            try:
                self.tracker.open()
                request()
                return None
            except PermanentError as exc:
                error = short_error(exc)
                break
            except Exception as exc:
                error = short_error(exc)
            if not self._backoff(backoff, give_up):
                break
            backoff = min(backoff * 2, 10.0)
        log.warning("%s: export gave up: %s", self.tracker.where, error)
        return error

    def _backoff(self, seconds: float, give_up: float) -> bool:
        """Wait ``seconds`` (less when close() brings the deadline nearer); False when the
        budget or the deadline leaves no time for another try."""
        wake_at = self._clock() + seconds
        with self._cond:
            while True:
                deadline = give_up if self._deadline is None else min(give_up, self._deadline)
                now = self._clock()
                if deadline <= now or self._abandoned:
                    return False
                if now >= wake_at:
                    return True
                self._cond.wait(min(wake_at, deadline) - now)
