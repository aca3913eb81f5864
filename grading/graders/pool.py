"""Graders that are not known to finish run in spawned subprocesses, under deadlines.

A pure-Python grader stuck in a loop holds the GIL, and no thread can interrupt it; the only
real time limit is a process that can be killed. :class:`IsolatedGrader` wraps a picklable
grader (an instance of a module-level class) and grades batches in ``processes`` spawned
workers (spawn, not fork: the trainer process holds torch and vLLM threads):

- each call has ``timeout_s``, counted from when the worker starts it; a call past it scores 0
  as a ``"timeout"``, its worker is killed and replaced, and the batch goes on;
- the whole batch has ``batch_timeout_s``: what is not graded by then scores 0 as timeouts, so
  a grader that hangs on every completion costs one batch budget per step, not N timeouts;
- a call that raises, or returns something that is not a score in [0, 1], scores 0 as an
  ``"error"``, like an inline grader (``grading.graders.grade_one`` runs in the worker); a worker
  that dies (a crash, ``os._exit``) fails its current call as an ``"error"`` and is replaced.

Workers are started on first use, kept between batches, and stopped by :meth:`close`, when the
grader is garbage-collected, or at interpreter exit (they are daemons). On Linux a worker also
dies with its parent (``PR_SET_PDEATHSIG``), so a killed trainer leaves no spinning grader.
This is a time limit, not a sandbox: the grader runs with the trainer's permissions.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from grading.graders.base import Failure, Graded, Grader, Item, grade_one

__all__ = ["IsolatedGrader"]

_READY = "ready"
STARTUP_TIMEOUT_S = 60.0  # spawning a worker imports the grader's module (not torch): seconds


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _serve(conn: Connection, grader: Grader, parent_pid: int) -> None:
    """Worker main: grade (index, completion, item) triples, answering (index, score, failure)
    as each finishes; None ends the worker."""
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        return
    warm = getattr(grader, "warm", None)
    if callable(warm):
        # Slow imports (sympy) happen here, under the start-up deadline, not in the first
        # call's time limit.
        warm()
    conn.send(_READY)
    while True:
        try:
            items = conn.recv()
        except EOFError:
            return
        if items is None:
            return
        for index, completion, item in items:
            graded = grade_one(grader, completion, item)
            conn.send((index, graded.score, graded.failure))


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    ready: bool = False
    queue: deque[tuple[int, object, object]] = field(default_factory=deque)
    deadline: float = 0.0  # when the call in progress (the head of the queue) runs out of time

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop()
    workers.clear()


class IsolatedGrader:
    """Run ``grader`` in subprocesses with a per-call and a per-batch time limit.

    ``name`` and ``weight`` are the wrapped grader's. It is a ``grading.graders.BatchGrader``:
    a :class:`~grading.graders.GraderSet` hands it whole batches.
    """

    def __init__(
        self,
        grader: Grader,
        *,
        timeout_s: float = 2.0,
        batch_timeout_s: float = 60.0,
        processes: int = 1,
    ) -> None:
        if not (timeout_s > 0 and batch_timeout_s > 0 and processes >= 1):
            raise ValueError("timeout_s and batch_timeout_s must be > 0 and processes >= 1")
        self.grader = grader
        self.timeout_s = float(timeout_s)
        self.batch_timeout_s = float(batch_timeout_s)
        self.processes = int(processes)
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        # Why the latest batch's first failed call failed (the API shows it; the loop's
        # grader event too), None when none did.
        self.first_error: str | None = None
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    @property
    def name(self) -> str:
        return self.grader.name

    @property
    def weight(self) -> float:
        return self.grader.weight

    def __call__(self, completion: str, item: Item) -> float:
        """One sample (a sub-grader of ``multi``); a failure raises, as a grader's does, so a
        timeout is not a score of 0."""
        graded = self.grade_batch([completion], [item])[0]
        if graded.failure is not None:
            raise RuntimeError(self.first_error or graded.failure)
        return graded.score

    def close(self) -> None:
        """Stop the workers (a later batch starts new ones)."""
        _stop_all(self._workers)

    # ------------------------------------------------------------------ one batch

    def grade_batch(self, completions: Sequence[object], items: Sequence[Item]) -> list[Graded]:
        if len(completions) != len(items):
            raise ValueError(f"{len(completions)} completions but {len(items)} items")
        n = len(completions)
        results: list[Graded | None] = [None] * n
        self.first_error = None
        if n == 0:
            return []
        while len(self._workers) < min(self.processes, n):
            self._workers.append(self._spawn())
        active = self._workers[: min(self.processes, n)]
        # Contiguous shares, so that a worker's results arrive in its queue's order.
        share = -(-n // len(active))
        for k, worker in enumerate(active):
            worker.queue = deque(
                (i, completions[i], dict(items[i]))
                for i in range(k * share, min(n, (k + 1) * share))
            )
            self._dispatch(worker)
        batch_deadline = time.monotonic() + self.batch_timeout_s
        busy = [w for w in active if w.queue]
        while busy:
            now = time.monotonic()
            if now >= batch_deadline:
                for worker in busy:
                    self._replace(worker)
                    for index, _, _ in worker.queue:
                        results[index] = Graded(0.0, "timeout")
                    worker.queue.clear()
                break
            wake = min([batch_deadline, *(w.deadline for w in busy)])
            ready = wait([w.conn for w in busy], timeout=max(0.0, wake - now))
            for worker in list(busy):
                if worker.conn in ready:
                    self._receive(worker, results)
                elif time.monotonic() >= worker.deadline:
                    self._fail_head(worker, results, "timeout")
            busy = [w for w in busy if w.queue]
        graded = [r if r is not None else Graded(0.0, "error") for r in results]
        self.first_error = next(
            (self._reason(g.failure) for g in graded if g.failure is not None), None
        )
        return graded

    def _reason(self, failure: Failure) -> str:
        if failure == "timeout":
            return f"the check ran past its time limit ({self.timeout_s:g} s) and was stopped"
        return "the check failed (it raised, crashed, or gave no score in [0, 1])"

    def _dispatch(self, worker: _Worker) -> None:
        """Send the worker its queue, once it is ready; arm the deadline of its first call."""
        if not worker.queue:
            return
        if not worker.ready:
            worker.deadline = time.monotonic() + STARTUP_TIMEOUT_S
            return  # sent on _READY
        worker.deadline = time.monotonic() + self.timeout_s
        # A worker that died meanwhile reads as end-of-file next: its head call fails then.
        with contextlib.suppress(OSError):
            worker.conn.send(list(worker.queue))

    def _receive(self, worker: _Worker, results: list[Graded | None]) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):  # the worker died during the call at the head
            self._fail_head(worker, results, "error")
            return
        if message == _READY:
            worker.ready = True
            self._dispatch(worker)
            return
        index, score, failure = message
        if worker.queue and worker.queue[0][0] == index:
            worker.queue.popleft()
            results[index] = Graded(score, failure)
            worker.deadline = time.monotonic() + self.timeout_s

    def _fail_head(self, worker: _Worker, results: list[Graded | None], failure: Failure) -> None:
        """The call at the head of the worker's queue failed (timed out, or killed the worker,
        or the worker never started): score it 0, replace the worker, resend the rest."""
        if not worker.ready:  # could not start: every call it was given fails
            for index, _, _ in worker.queue:
                results[index] = Graded(0.0, "error")
            worker.queue.clear()
        elif worker.queue:
            index, _, _ = worker.queue.popleft()
            results[index] = Graded(0.0, failure)
        self._replace(worker)
        self._dispatch(worker)

    def _replace(self, worker: _Worker) -> None:
        """Kill the worker's process and start a fresh one in the same slot."""
        worker.stop()
        fresh = self._spawn()
        worker.process, worker.conn, worker.ready = fresh.process, fresh.conn, False

    def _spawn(self) -> _Worker:
        parent, child = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_serve,
            args=(child, self.grader, os.getpid()),
            name=f"grader-{self.name}",
            daemon=True,
        )
        process.start()
        child.close()
        return _Worker(process, parent)

    def __repr__(self) -> str:
        return f"IsolatedGrader({self.grader!r}, timeout_s={self.timeout_s})"
