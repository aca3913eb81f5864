"""Workers by size class: a worker's device count (GRPO_WORKER_DEVICES, else what it finds), the
one queue it consumes (app.core.queue.queue_for), every re-send of a multi-device job going back
to that job's queue, and real `grpo worker` processes taking only the jobs of their size."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import select, update

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.models import Job, WorkerSighting
from app.core.settings import Settings
from app.jobs import size_classes, transitions
from app.jobs import workers_repository as workers_repo
from app.main import create_app
from jobspec.model_shape import host_memory
from tests.conftest import Api, RecordingDispatcher, new_project_key, tiny_spec
from tests.worker.conftest import ROOT, WorkerProcess, wait_for
from tests.worker.test_runner import fake_trainer
from worker import maintenance
from worker.context import WorkerContext
from worker.maintenance import reap_stale_jobs, redispatch_queued
from worker.runner import run_job
from worker.settings import build_worker_settings, detected_devices

TERMINAL = ("succeeded", "failed", "cancelled")


# ---- the worker's size -----------------------------------------------------------------------


def test_a_cpu_worker_has_one_device_and_consumes_the_base_queue(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("GRPO_WORKER_DEVICES", raising=False)
    settings = build_worker_settings(data_dir=tmp_path, queue_name="jobs", device="cpu")
    assert settings.worker_devices is None  # nothing found at build time
    assert settings.devices() == 1
    assert settings.consumed_queue == "jobs"


def test_the_environment_sets_the_workers_devices_and_so_its_queue(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GRPO_WORKER_DEVICES", "2")
    settings = build_worker_settings(data_dir=tmp_path, queue_name="jobs")
    assert settings.devices() == 2
    assert settings.consumed_queue == "jobs-2dev"
    for bad in ("0", "65", "two"):
        monkeypatch.setenv("GRPO_WORKER_DEVICES", bad)
        with pytest.raises(ValidationError, match="worker_devices"):
            build_worker_settings(data_dir=tmp_path)


def test_a_cuda_worker_counts_the_devices_it_sees_and_falls_back_to_one() -> None:
    # This machine's torch has no CUDA: `cuda` finds none and counts one. A named device is
    # one device whatever the machine holds.
    assert detected_devices("cuda") == 1
    assert detected_devices("cuda:1") == 1
    assert detected_devices("cpu") == 1


def test_building_the_settings_loads_no_torch(tmp_path: Path) -> None:
    """The count is found when the worker starts (worker.main), not when settings are built
    (the heartbeat process builds them too, and a CPU worker never needs torch)."""
    code = (
        "import sys\n"
        "from worker.settings import build_worker_settings\n"
        f"s = build_worker_settings(data_dir={str(tmp_path)!r}, device='cuda')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


# ---- every re-send goes back to the job's size class -----------------------------------------


def test_a_two_device_jobs_hand_over_requeue_and_resend_all_go_to_its_queue(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The database is shared with earlier tests, whose waiting jobs one sweep may send first
    # (at most SWEEP_BATCH, oldest first): lift the bound to reach ours.
    monkeypatch.setattr(maintenance, "SWEEP_BATCH", 100_000)
    sent_by_api = RecordingDispatcher()
    spec = tiny_spec(steps=4) | {"resources": {"devices": 2}}
    key, _ = new_project_key(settings)
    with TestClient(create_app(settings, sent_by_api)) as client:
        created = client.post("/v1/jobs", json=spec, headers={"Authorization": f"Bearer {key}"})
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    queue = f"{settings.queue_name}-2dev"
    assert sent_by_api.queues == {job_id: queue}

    ctx = WorkerContext(
        build_worker_settings(
            data_dir=settings.data_dir,
            database_url=settings.resolved_database_url,
            queue_name=settings.queue_name,  # this worker's own queue is the one-device one
            lease_seconds=30,
            redispatch_seconds=30,
            db_retry_seconds=1,
        ),
        make_session_factory(make_engine(settings.resolved_database_url)),
        RecordingDispatcher(),
    )
    dispatcher: RecordingDispatcher = ctx.dispatcher  # type: ignore[assignment]

    def sent_again(times: int) -> str | None:
        """The queue the job was sent to last, once it has been sent `times` times."""
        assert dispatcher.sent.count(job_id) == times
        return dispatcher.queues[job_id]

    # A graceful hand-over (SIGTERM) re-sends it.
    def sigterm(step: int) -> None:
        if step == 1:
            ctx.shutdown.set()

    assert run_job(ctx, job_id, train=fake_trainer(4, sigterm)) == "released"
    assert sent_again(1) == queue
    ctx.shutdown.clear()

    # The reaper re-queues it once its worker is gone.
    with session_scope(ctx.sessions) as session:
        assert transitions.claim(session, job_id, "lost-worker") is not None
    _age(ctx, job_id)
    assert job_id in reap_stale_jobs(ctx)
    assert sent_again(2) == queue

    # The sweep re-sends it when its message may be lost (while a two-device worker runs: the
    # sweep sends nothing to a size class no worker announced).
    with session_scope(ctx.sessions) as session:
        workers_repo.announce(
            session,
            name=f"two-devices-{secrets.token_hex(3)}",
            queue_name=settings.queue_name,
            devices=2,
            now=utcnow(),
        )
    _age(ctx, job_id)
    assert job_id in redispatch_queued(ctx)
    assert sent_again(3) == queue


def _age(ctx: WorkerContext, job_id: str) -> None:
    past = utcnow() - timedelta(seconds=120)
    with session_scope(ctx.sessions) as session:
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(updated_at=past, dispatched_at=past, heartbeat_at=past)
        )


# ---- workers announce their size class -------------------------------------------------------


def test_workers_announce_their_size_so_a_job_no_worker_runs_is_told(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each maintenance pass writes the worker's size class (worker.maintenance.announce_worker);
    the API warns a job of a size no worker announced (app.jobs.size_classes)."""
    monkeypatch.setattr(size_classes, "REFRESH_S", 0.0)  # each create reads the table afresh
    settings.queue_name = f"{settings.queue_name}-{secrets.token_hex(3)}"  # no other workers
    sessions = make_session_factory(make_engine(settings.resolved_database_url))

    def announce(devices: int) -> None:
        worker = build_worker_settings(
            data_dir=settings.data_dir,
            database_url=settings.resolved_database_url,
            queue_name=settings.queue_name,
            worker_devices=devices,
            worker_name=f"worker-{devices}-{secrets.token_hex(3)}",
        )
        maintenance.announce_worker(WorkerContext(worker, sessions, RecordingDispatcher()))

    key, _ = new_project_key(settings)
    two_devices = tiny_spec() | {"resources": {"devices": 2}}
    with TestClient(create_app(settings, RecordingDispatcher())) as client:

        def created_warnings() -> list[str]:
            response = client.post(
                "/v1/jobs", json=two_devices, headers={"Authorization": f"Bearer {key}"}
            )
            assert response.status_code == 201, response.text
            return list(response.json()["warnings"])

        announce(1)
        assert len(created_warnings()) == 1  # only one-device workers run
        announce(2)
        assert created_warnings() == []
    # Each announced what it trains on, for the API's memory plan: this host's CPU and memory.
    with session_scope(sessions) as session:
        rows = session.scalars(
            select(WorkerSighting).where(WorkerSighting.queue_name == settings.queue_name)
        ).all()
        assert {(r.devices, r.device_kind, r.device_memory) for r in rows} == {
            (1, "cpu", host_memory()),
            (2, "cpu", host_memory()),
        }


# ---- real worker processes -------------------------------------------------------------------


def _job(api: Api, job_id: str) -> dict[str, Any]:
    body: dict[str, Any] = api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json()
    return body


def _owner(api: Api, job_id: str) -> str | None:
    """The worker that claimed the job (its status event `queued -> running`), or None."""
    events = api.client.get(f"/v1/jobs/{job_id}/events", headers=api.headers).json()["data"]
    owners = [(e["data"] or {}).get("owner") for e in events if e["type"] == "status"]
    return next((o for o in owners if o), None)


@pytest.mark.parametrize("backend", ["postgres"])  # Redis, the deployment's broker
def test_a_worker_takes_only_the_jobs_of_its_size_class(
    api: Api, start_worker: Callable[..., WorkerProcess]
) -> None:
    # A queue of its own: API tests leave unconsumed messages on the session's queue.
    api.settings.queue_name = f"{api.settings.queue_name}-{secrets.token_hex(3)}"
    one = start_worker(api.settings, GRPO_WORKER_DEVICES="1", GRPO_WORKER_NAME="one-device")
    two_devices = tiny_spec() | {"resources": {"devices": 2}}

    def dry_run_warnings() -> list[str]:
        checked = api.client.post("/v1/jobs/validate", json=two_devices, headers=api.headers)
        assert checked.status_code == 200, checked.text
        return list(checked.json()["warnings"])

    # The worker announces itself as it starts: a job of a size it is not is told so (once
    # this API process reads the workers again: it trusts a read for REFRESH_S seconds). A
    # loaded machine takes a while to start a worker: the budget of the wait below.
    wait_for(dry_run_warnings, 180, "the one-device worker's announcement")
    big = api.client.post("/v1/jobs", json=two_devices, headers=api.headers)
    assert big.status_code == 201, big.text
    assert "no worker of 2 device(s)" in big.json()["warnings"][0]
    small = api.client.post("/v1/jobs", json=tiny_spec(), headers=api.headers)
    assert small.status_code == 201, small.text
    big_id, small_id = big.json()["id"], small.json()["id"]

    # The one-device worker trains the job submitted after the two-device one ...
    try:
        done = wait_for(
            lambda: (job := _job(api, small_id))["status"] in TERMINAL and job,
            240,
            "the one-device job to finish",
        )
    except AssertionError:
        raise AssertionError(one.log_tail()) from None
    assert isinstance(done, dict) and done["status"] == "succeeded", (done, one.log_tail())
    assert _owner(api, small_id) == "one-device"
    # ... and never takes the two-device job, which waits in its own queue.
    waiting = _job(api, big_id)
    assert (waiting["status"], waiting["attempt"], waiting["devices"]) == ("queued", 0, 2)
    log = one.log_tail(50_000)
    assert f"consuming queue '{api.settings.queue_name}'" in log and "1 device(s)" in log
    assert big_id not in log

    # A two-device worker takes it.
    two = start_worker(api.settings, GRPO_WORKER_DEVICES="2", GRPO_WORKER_NAME="two-devices")
    try:
        wait_for(lambda: _owner(api, big_id), 180, "a worker to claim the two-device job")
    except AssertionError:
        raise AssertionError(two.log_tail()) from None
    assert _owner(api, big_id) == "two-devices"
    assert f"consuming queue '{api.settings.queue_name}-2dev'" in two.log_tail(50_000)
