"""Worker liveness: the lease is kept, and a cancel or SIGTERM takes effect within a bounded
time, whatever the trainer does, including holding the GIL in one long C call.

The trainers here hold the GIL the way a catastrophic regex in a grader did: one call into the
`re` module's C matcher, which backtracks 2**n ways and never lets another thread run. A
heartbeat thread in the trainer's process would be starved (the reaper then re-queued live
jobs); the heartbeat process is not.

The first test runs `run_job` in this process. The others need the trainer in a process of its
own, to be stuck and then killed: a spawned child runs `run_job` the way a Celery worker does
(SIGTERM sets the shutdown flag, as Celery's warm-shutdown handler does), so they are `process`.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import re
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from app.core.clock import as_utc, utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.ids import new_id
from app.core.models import Job, JobEvent
from app.core.settings import Settings
from app.jobs import pausing, transitions
from app.jobs import service as jobs_service
from jobspec import JobSpec
from tests.conftest import RecordingDispatcher, new_project_key, tiny_spec, wait_until
from tests.worker.test_runner import FakeResult
from trainer.run.callbacks import Callbacks, RunInfo
from worker.context import WorkerContext
from worker.maintenance import reap_stale_jobs
from worker.runner import run_job
from worker.settings import WorkerSettings, build_worker_settings

LEASE_S = 2.0
GRACE_S = 2.0
# Generous: a loaded CI machine, a spawned child importing the app, a database under load.
MARGIN_S = 30.0
START_S = 120.0  # a spawned worker process importing the trainer, under load
CATASTROPHIC = re.compile(r"(a+)+$")

# Every test here runs the heartbeat process against a trainer that holds the GIL for seconds.
pytestmark = pytest.mark.process


def hold_the_gil(chars: int) -> None:
    """One call into `re`'s C matcher that fails after backtracking about 2**chars ways, all
    the while holding the GIL."""
    CATASTROPHIC.match("a" * chars + "!")


@functools.cache
def chars_for(seconds: float) -> int:
    """How many characters make `hold_the_gil` last at least `seconds` on this machine (each
    character doubles the time)."""
    chars = 16
    while True:
        clock = time.perf_counter()
        hold_the_gil(chars)
        took = time.perf_counter() - clock
        if took >= 0.05:
            return chars + max(0, math.ceil(math.log2(seconds / took)))
        chars += 1


def worker_settings(settings: Settings, tmp_path: Path) -> WorkerSettings:
    return build_worker_settings(
        data_dir=settings.data_dir,
        database_url=settings.resolved_database_url,
        broker_url=settings.resolved_broker_url,
        checkpoint_dir=tmp_path / "checkpoints",
        worker_name="liveness-under-test",
        lease_seconds=LEASE_S,
        heartbeat_seconds=0.25,
        stop_grace_seconds=GRACE_S,
        max_attempts=2,
        db_retry_seconds=1,
    )


@pytest.fixture
def ctx(settings: Settings, tmp_path: Path) -> WorkerContext:
    ws = worker_settings(settings, tmp_path)
    engine = make_engine(ws.resolved_database_url)
    return WorkerContext(ws, make_session_factory(engine), RecordingDispatcher())


def make_job(ctx: WorkerContext) -> str:
    # A queue no worker consumes: a job handed back must not be trained by another test's worker.
    queue = f"liveness-{secrets.token_hex(4)}"
    _, project_id = new_project_key(ctx.settings)
    spec = JobSpec.model_validate(tiny_spec(steps=2))
    with session_scope(ctx.sessions) as session:
        job = Job(
            id=new_id("job"),
            project_id=project_id,
            spec=spec.model_dump(mode="json"),
            created_at=utcnow(),
            updated_at=utcnow(),
            total_steps=2,
            max_attempts=2,
            queue=queue,
        )
        transitions.record_created(session, job)
        return job.id


def job(ctx: WorkerContext, job_id: str) -> Job:
    with session_scope(ctx.sessions) as session:
        row = session.get(Job, job_id)
        assert row is not None
        return row


def last_status_message(ctx: WorkerContext, job_id: str) -> str:
    with session_scope(ctx.sessions) as session:
        query = (
            select(JobEvent.message)
            .where(JobEvent.job_id == job_id, JobEvent.type == "status")
            .order_by(JobEvent.id.desc())
        )
        return str(session.scalars(query).first())


def quick_trainer(spec: JobSpec, callbacks: Callbacks, **_: Any) -> FakeResult:
    callbacks.on_start(RunInfo(2, 0, Path("/model"), Path("/out"), "cpu", "fake"))
    for step in (1, 2):
        callbacks.on_step(step, {"loss": 0.1})
    return FakeResult(2)


def never_trains(spec: JobSpec, callbacks: Callbacks, **_: Any) -> FakeResult:
    raise AssertionError("a finished job must not train again")


# --------------------------------------------------------------------------- in this process


def test_the_lease_is_kept_while_the_trainer_holds_the_gil(ctx: WorkerContext) -> None:
    job_id = make_job(ctx)
    chars = chars_for(3 * LEASE_S)
    seen: dict[str, Any] = {}

    def train(spec: JobSpec, callbacks: Callbacks, **_: Any) -> FakeResult:
        callbacks.on_start(RunInfo(1, 0, Path("/model"), Path("/out"), "cpu", "fake"))
        seen["call_started"] = utcnow()
        clock = time.monotonic()
        hold_the_gil(chars)
        seen["held_s"] = time.monotonic() - clock
        # Right after the call, before this process writes anything: what the reaper sees.
        seen["requeued"] = reap_stale_jobs(ctx)
        seen["row"] = job(ctx, job_id)
        callbacks.on_step(1, {"loss": 0.1})
        return FakeResult(1)

    assert run_job(ctx, job_id, train=train) == "succeeded"
    # The call really outlasted the lease (else this test would prove nothing).
    assert seen["held_s"] >= 2 * LEASE_S, seen["held_s"]
    assert job_id not in seen["requeued"]
    during = seen["row"]
    assert (during.status, during.attempt) == ("running", 1)
    # Beats landed while this process could not run a line of Python.
    assert as_utc(during.heartbeat_at) > seen["call_started"] + timedelta(seconds=LEASE_S)
    assert job(ctx, job_id).status == "succeeded"


# --------------------------------------------------------------------------- a stuck worker


def _stuck_worker(settings: dict[str, Any], job_id: str, chars: int, pid_file: str) -> None:
    """A worker process (spawned) whose trainer never returns: after on_start it holds the GIL
    in one long C call after another and never asks should_stop."""
    ws = WorkerSettings(**settings)
    ctx = WorkerContext(
        ws, make_session_factory(make_engine(ws.resolved_database_url)), RecordingDispatcher()
    )
    # What Celery's warm-shutdown handler does (worker.celery_app).
    signal.signal(signal.SIGTERM, lambda *_: ctx.shutdown.set())

    def train(spec: JobSpec, callbacks: Callbacks, **_: Any) -> FakeResult:
        callbacks.on_start(RunInfo(2, 0, Path("/model"), Path("/out"), "cpu", "fake"))
        heartbeat_pid = callbacks.lease.heartbeat_pid  # type: ignore[attr-defined]
        Path(pid_file).write_text(f"{heartbeat_pid}\n")
        while True:
            hold_the_gil(chars)

    run_job(ctx, job_id, train=train)


@dataclass
class StuckWorker:
    job_id: str
    process: BaseProcess
    pid_file: Path

    def heartbeat_pid(self) -> int:
        """Once the trainer is stuck: the pid of the heartbeat process."""
        # Starting a spawned process is not what is timed here (the grace is): on a loaded
        # 2-core machine it took over 30 s once.
        wait_until(self.pid_file.exists, START_S, "the stuck trainer to start")
        return int(self.pid_file.read_text())


@pytest.fixture
def stuck_worker(ctx: WorkerContext, tmp_path: Path) -> Iterator[StuckWorker]:
    job_id = make_job(ctx)
    pid_file = tmp_path / "heartbeat.pid"
    spawn = multiprocessing.get_context("spawn")
    process = spawn.Process(
        target=_stuck_worker,
        args=(ctx.settings.model_dump(), job_id, chars_for(2.0), str(pid_file)),
        name=f"stuck-worker-{job_id}",
    )
    process.start()
    try:
        yield StuckWorker(job_id, process, pid_file)
    finally:
        if process.is_alive():
            process.kill()
        process.join(10)


def gone(pid: int) -> bool:
    """The process exited (a zombie waiting for a reaper counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@pytest.mark.process
def test_a_cancel_ends_a_stuck_trainer_within_the_grace(
    ctx: WorkerContext, stuck_worker: StuckWorker
) -> None:
    job_id = stuck_worker.job_id
    heartbeat = stuck_worker.heartbeat_pid()
    with session_scope(ctx.sessions) as session:
        row = jobs_service.get_job(session, project_id=job(ctx, job_id).project_id, job_id=job_id)
        assert jobs_service.cancel_job(session, job=row).status == "cancelling"

    wait_until(
        lambda: job(ctx, job_id).status == "cancelled", GRACE_S + MARGIN_S, "the job cancelled"
    )
    assert "did not stop within 2s" in last_status_message(ctx, job_id)
    # The stuck worker was killed, and its heartbeat process went with it.
    stuck_worker.process.join(MARGIN_S)
    assert stuck_worker.process.exitcode == -signal.SIGKILL
    wait_until(lambda: gone(heartbeat), MARGIN_S, "the heartbeat process to exit")
    # Celery re-delivers the dead worker's unacknowledged message: it finds nothing to do.
    assert run_job(ctx, job_id, train=never_trains) == "not_claimed"
    assert job(ctx, job_id).status == "cancelled"


@pytest.mark.process
def test_a_pause_ends_a_stuck_trainer_within_the_grace_and_keeps_its_attempt(
    ctx: WorkerContext, stuck_worker: StuckWorker
) -> None:
    job_id = stuck_worker.job_id
    heartbeat = stuck_worker.heartbeat_pid()
    attempts_before = job(ctx, job_id).max_attempts
    with session_scope(ctx.sessions) as session:
        row = jobs_service.get_job(session, project_id=job(ctx, job_id).project_id, job_id=job_id)
        assert pausing.pause_job(session, job=row).status == "pausing"

    wait_until(lambda: job(ctx, job_id).status == "paused", GRACE_S + MARGIN_S, "the job paused")
    assert "did not stop within 2s" in last_status_message(ctx, job_id)
    assert job(ctx, job_id).max_attempts == attempts_before + 1
    stuck_worker.process.join(MARGIN_S)
    assert stuck_worker.process.exitcode == -signal.SIGKILL
    wait_until(lambda: gone(heartbeat), MARGIN_S, "the heartbeat process to exit")
    assert run_job(ctx, job_id, train=never_trains) == "not_claimed"  # paused: nobody runs it


@pytest.mark.process
def test_sigterm_hands_a_stuck_trainer_s_job_back_within_the_grace(
    ctx: WorkerContext, stuck_worker: StuckWorker
) -> None:
    job_id = stuck_worker.job_id
    stuck_worker.heartbeat_pid()
    assert stuck_worker.process.pid is not None
    os.kill(stuck_worker.process.pid, signal.SIGTERM)

    # Handed back, then re-sent: the send (and its `dispatched_at` stamp) follows the commit.
    wait_until(
        lambda: job(ctx, job_id).status == "queued" and job(ctx, job_id).dispatched_at,
        GRACE_S + MARGIN_S,
        "the job handed back and re-sent",
    )
    handed_back = job(ctx, job_id)
    assert handed_back.lease_owner is None
    assert handed_back.max_attempts == 3  # a hand-over does not spend an attempt
    assert "did not stop within 2s" in last_status_message(ctx, job_id)
    stuck_worker.process.join(MARGIN_S)
    assert stuck_worker.process.exitcode == -signal.SIGKILL
    # The next worker takes it from there.
    assert run_job(ctx, job_id, train=quick_trainer) == "succeeded"
    assert job(ctx, job_id).attempt == 2


@pytest.mark.process
def test_the_heartbeat_process_exits_with_its_worker(
    ctx: WorkerContext, stuck_worker: StuckWorker
) -> None:
    job_id = stuck_worker.job_id
    heartbeat = stuck_worker.heartbeat_pid()
    assert not gone(heartbeat)
    stuck_worker.process.kill()  # kill -9: no handler, no `done`
    stuck_worker.process.join(MARGIN_S)
    wait_until(lambda: gone(heartbeat), MARGIN_S, "the heartbeat process to exit")
    # Nothing keeps the lease now: the reaper takes the job back once it is stale.
    beat = as_utc(job(ctx, job_id).heartbeat_at)
    assert beat is not None
    wait_until(
        lambda: (
            as_utc(job(ctx, job_id).heartbeat_at) == beat
            and utcnow() - beat > timedelta(seconds=LEASE_S)
        ),
        MARGIN_S,
        "the lease to go stale",
    )
    assert job_id in reap_stale_jobs(ctx)
