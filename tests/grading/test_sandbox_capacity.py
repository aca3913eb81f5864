"""Sandbox capacity (grading.sandbox.capacity): slots per process and per project, a bounded
queue with a time limit, and starts the host refuses reported as SandboxBusy, never raised raw."""

from __future__ import annotations

import errno
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from grading.graders.python import PythonGrade
from grading.sandbox import (
    SandboxBusy,
    SandboxCapacity,
    SandboxPool,
    build_sandbox_settings,
)
from grading.sandbox.capacity import PER_PROJECT_LIMIT, TOTAL_LIMIT
from tests.conftest import wait_until

GOOD = "def grade(sample, item):\n    return 1.0"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def waiting(capacity: SandboxCapacity) -> int:
    with capacity._lock:
        return len(capacity._queue)


def test_one_project_cannot_take_every_slot() -> None:
    capacity = SandboxCapacity(total=4, per_project=2, queue_timeout_s=0.0)
    a = [capacity.acquire("a"), capacity.acquire("a")]
    assert capacity.acquire("a", wait=False) is None  # at its cap, with two slots free
    b = capacity.acquire("b", wait=False)
    assert b is not None and len({*a, b}) == 3
    with pytest.raises(SandboxBusy) as refused:
        capacity.acquire("a")  # no time to wait: refused, naming its own project's cap
    assert refused.value.per_project and refused.value.limit == PER_PROJECT_LIMIT
    assert refused.value.retry_after_s >= 1 and PER_PROJECT_LIMIT in str(refused.value)
    assert capacity.acquire(None, wait=False) is not None  # a worker: only the total counts
    with pytest.raises(SandboxBusy) as full:
        capacity.acquire("c")
    assert not full.value.per_project and full.value.limit == TOTAL_LIMIT


def test_a_freed_slot_goes_to_the_first_waiter_that_may_take_it() -> None:
    capacity = SandboxCapacity(total=2, per_project=1, queue_timeout_s=30.0)
    a, b = capacity.acquire("a"), capacity.acquire("b")
    assert a is not None and b is not None
    with ThreadPoolExecutor(2) as pool:
        # a's second request queues first, but a is at its cap: b's slot must not go to it.
        a_again: Future[int | None] = pool.submit(capacity.acquire, "a")
        wait_until(lambda: waiting(capacity) == 1, 10, "a's request to queue", 0.01)
        c: Future[int | None] = pool.submit(capacity.acquire, "c")
        wait_until(lambda: waiting(capacity) == 2, 10, "c's request to queue", 0.01)
        capacity.release(b)
        assert c.result(timeout=10) == b
        assert not a_again.done()
        capacity.release(a)
        assert a_again.result(timeout=10) == a
    assert capacity.held("a") == 1 and capacity.held("b") == 0 and capacity.held("c") == 1


def test_the_queue_is_bounded_per_project_and_in_all() -> None:
    capacity = SandboxCapacity(total=1, per_project=1, queue_timeout_s=30.0)
    held = capacity.acquire("a")
    assert held is not None
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(capacity.acquire, "a")
        wait_until(lambda: waiting(capacity) == 1, 10, "a's second request to queue", 0.01)
        started = time.monotonic()
        with pytest.raises(SandboxBusy) as own:
            capacity.acquire("a")  # a's third: its queue is full, refused at once
        with pytest.raises(SandboxBusy) as everyone:
            capacity.acquire("b")  # the process's queue (total=1) is full too
        assert time.monotonic() - started < 5  # neither waited its 30 s
        assert own.value.per_project and "as many wait already" in str(own.value)
        assert not everyone.value.per_project and everyone.value.limit == TOTAL_LIMIT
        capacity.release(held)
        assert queued.result(timeout=10) == held


def test_a_wait_ends_at_the_queue_time_limit() -> None:
    capacity = SandboxCapacity(total=1, per_project=1, queue_timeout_s=0.3)
    assert capacity.acquire("a") is not None
    started = time.monotonic()
    with pytest.raises(SandboxBusy) as busy:
        capacity.acquire("b")
    assert 0.25 <= time.monotonic() - started < 10
    assert "GRPO_SANDBOX_QUEUE_TIMEOUT_S" in str(busy.value) and waiting(capacity) == 0


def refusing_popen(refusals: int | None) -> tuple[Callable[..., Any], list[int]]:
    """subprocess.Popen that fails as fork does under a process limit (BlockingIOError,
    EAGAIN) ``refusals`` times (None: always), then starts the process."""
    calls: list[int] = []
    real = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> Any:
        if not str(args[0][0]).endswith("bwrap"):  # not a sandbox (ctypes looking up a library)
            return real(*args, **kwargs)
        calls.append(1)
        if refusals is None or len(calls) <= refusals:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return real(*args, **kwargs)

    return popen, calls


@needs_bwrap
def test_a_start_the_host_refuses_for_a_moment_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    popen, calls = refusing_popen(2)
    monkeypatch.setattr("grading.sandbox.command.subprocess.Popen", popen)
    capacity = SandboxCapacity(total=1, per_project=1, queue_timeout_s=0.0)
    pool = SandboxPool(GOOD, build_sandbox_settings(processes=1), capacity=capacity)
    try:
        assert [v.score for v in pool.grade([{}], [{}])] == [1.0]
        assert len(calls) == 3
    finally:
        pool.close()
    assert capacity.acquire("x", wait=False) is not None  # its slot came back


@needs_bwrap
def test_a_start_the_host_keeps_refusing_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    popen, _ = refusing_popen(None)
    monkeypatch.setattr("grading.sandbox.command.subprocess.Popen", popen)
    settings = build_sandbox_settings(processes=1, startup_timeout_s=0.5)
    # On a worker: every sample fails with the reason, the job goes on.
    worker = PythonGrade("py", 1.0, GOOD, settings=settings)
    assert worker.grade_batch(["x"], [{}]) == [(0.0, "error")]
    assert worker.first_error is not None and "could not start" in worker.first_error
    # For a request holding a slot: SandboxBusy (the API answers 503), not BlockingIOError.
    capacity = SandboxCapacity(total=1, per_project=1, queue_timeout_s=0.0)
    with capacity.slot("p") as slot:
        request = PythonGrade("py", 1.0, GOOD, settings=settings, slot=slot)
        with pytest.raises(SandboxBusy) as busy:
            request.grade_batch(["x"], [{}])
    assert not busy.value.per_project and busy.value.limit == "GRPO_SANDBOX_MAX_PROCESSES"
    assert capacity.held("p") == 0


@needs_bwrap
def test_pools_of_one_worker_share_its_slots_without_waiting_on_each_other() -> None:
    """Three graders of one job, graded one after another on one thread, in two slots: a pool
    idle between batches gives its slots back when none is free, so the next never waits."""
    capacity = SandboxCapacity(total=2, per_project=1, queue_timeout_s=0.0)
    settings = build_sandbox_settings(processes=2)
    pools = [SandboxPool(GOOD, settings, capacity=capacity) for _ in range(3)]
    try:
        for _ in range(2):
            for pool in pools:
                assert [v.score for v in pool.grade([{}] * 3, [{}] * 3)] == [1.0] * 3
                assert capacity.held(None) <= 2
    finally:
        for pool in pools:
            pool.close()
    assert capacity.held(None) == 0


def test_slots_are_never_over_given_under_contention() -> None:
    capacity = SandboxCapacity(total=3, per_project=2, queue_timeout_s=10.0)
    lock = threading.Lock()
    inside: dict[str, int] = {"all": 0, "max": 0}
    per: dict[str, int] = {}
    worst: dict[str, int] = {}

    def use(project: str) -> None:
        with capacity.slot(project):
            with lock:
                inside["all"] += 1
                per[project] = per.get(project, 0) + 1
                inside["max"] = max(inside["max"], inside["all"])
                worst[project] = max(worst.get(project, 0), per[project])
            time.sleep(0.005)
            with lock:
                inside["all"] -= 1
                per[project] -= 1

    outcomes: list[Future[None]] = []
    with ThreadPoolExecutor(8) as pool:
        for i in range(60):
            outcomes.append(pool.submit(use, "abc"[i % 3]))
    errors = [f.exception() for f in outcomes if f.exception() is not None]
    assert all(isinstance(e, SandboxBusy) for e in errors), errors
    assert inside["max"] <= 3 and max(worst.values()) <= 2
