"""Waiting for a job to end, with a progress bar on stderr, a deadline, and patience for an API
that is briefly unreachable (a restart or a network blip must not fail a CI pipeline)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from tqdm import tqdm

from grpo_cli.client import ApiError, Client, StreamMessage

TERMINAL = ("succeeded", "failed", "cancelled")
RETRY_FOR_S = 60.0  # how long an unreachable or failing (5xx) API is retried: --retry-for

T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: no connection, a 5xx, 409 (a state change in flight), 429."""
    if isinstance(exc, ApiError):
        # A 409 is a race (a job changing state, a keyed request in flight) unless the API
        # says the job's state rules the request out for good (invalid_state).
        if exc.status == 409:
            return exc.type != "invalid_state"
        return exc.status >= 500 or exc.status == 429
    return isinstance(exc, httpx.TransportError | ConnectionError)


def retrying(
    grace_s: float,
    call: Callable[[], T],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """`call()`, retried with backoff while it fails transiently, for up to `grace_s` seconds.
    Only for idempotent requests (reads, cancel, keyed submits): a busy database answering one
    503 must not fail a pipeline."""
    start, delay = clock(), 0.25
    while True:
        try:
            return call()
        except (ApiError, httpx.TransportError) as exc:
            if not is_transient(exc) or clock() - start + delay > grace_s:
                raise
        sleep(delay)
        delay = min(4.0, delay * 2)


def stream_patiently(
    client: Client,
    job_id: str,
    grace_s: float = RETRY_FOR_S,
    max_reconnects: int = 3,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[StreamMessage]:
    """The job's SSE stream to its end. Client.stream already resumes a dropped connection with
    Last-Event-ID, but gives up after `max_reconnects` quick tries and does not retry a 503 (the
    API up, its database down); this resumes from the last id seen for up to `grace_s` seconds
    without a message, so a restart of the API or its database does not cut a follow short."""
    last_id: str | None = None
    last_seen = clock()
    while True:
        try:
            for message in client.stream(job_id, last_id, max_reconnects=max_reconnects):
                last_seen = clock()
                if message.id is not None:
                    last_id = message.id
                yield message
                if message.event == "end":
                    return
            return
        except (ApiError, httpx.TransportError, ConnectionError) as exc:
            if not is_transient(exc) or clock() - last_seen > grace_s:
                raise
        sleep(1.0)


@dataclass(frozen=True)
class WaitResult:
    job: dict[str, Any]  # the last state seen
    timed_out: bool


class _Progress:
    """A tqdm bar on stderr. On a terminal it is redrawn every poll (the clock moves); in a CI
    log, whose carriage returns may become new lines, only when the step or status changed."""

    def __init__(self, job: dict[str, Any], enabled: bool) -> None:
        self.enabled = enabled
        self.live = sys.stderr.isatty()
        self.state: tuple[int, str] | None = None
        self.bar = tqdm(
            total=job["progress"]["total_steps"],
            desc=job["id"],
            unit="step",
            file=sys.stderr,
            disable=not enabled,
            dynamic_ncols=True,
        )

    def show(self, step: int, total: int, note: str) -> None:
        if not self.enabled:
            return
        changed = self.state != (step, note)
        self.state = (step, note)
        self.bar.total = total
        self.bar.n = step
        self.bar.set_postfix_str(note, refresh=False)
        if changed or self.live:
            self.bar.refresh()

    def job(self, job: dict[str, Any]) -> None:
        progress = job["progress"]
        reward = (progress.get("last_metrics") or {}).get("reward/mean")
        note = job["status"] + ("" if reward is None else f", reward {reward:.3g}")
        self.show(progress["step"], progress["total_steps"], note)

    def close(self) -> None:
        self.bar.close()


def wait_for_job(
    client: Client,
    job: dict[str, Any],
    *,
    deadline: float | None,
    poll_s: float,
    show_progress: bool,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    outage_grace_s: float = RETRY_FOR_S,
) -> WaitResult:
    """Poll the job until it is terminal or `deadline` (a `clock()` value) passes."""
    if job["status"] in TERMINAL:
        return WaitResult(job, timed_out=False)
    bar = _Progress(job, show_progress)
    last_ok = clock()
    try:
        while True:
            if job["status"] in TERMINAL:
                return WaitResult(job, timed_out=False)
            if deadline is not None and clock() >= deadline:
                return WaitResult(job, timed_out=True)
            wait = poll_s if deadline is None else max(0.0, min(poll_s, deadline - clock()))
            sleep(wait)
            try:
                job = client.get_job(job["id"])
                last_ok = clock()
            except (ApiError, httpx.TransportError) as exc:
                if not is_transient(exc) or clock() - last_ok > outage_grace_s:
                    raise
                progress = job["progress"]
                note = f"API unavailable, retrying ({type(exc).__name__})"
                bar.show(progress["step"], progress["total_steps"], note)
                continue
            bar.job(job)
    finally:
        bar.close()
