"""A job on two devices through the service: real Postgres, Redis and `grpo worker`, the worker
running the job's ranks under torchrun (worker.runner.load_trainer -> launch_ranks), two gloo
ranks on CPU. The job succeeds with one metrics row per step; a rank killed with SIGKILL hands
the attempt back to the queue and the next one resumes from the last checkpoint, an async job's
too (its one rollout server, rank 0's, exits with the attempt). No rank may outlive its
attempt.

The worker is started with GRPO_WORKER_DEVICES=2: a worker's device count decides which jobs it
takes once the queues are routed by device count (and does nothing before)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.core.settings import build_settings
from tests.conftest import REDIS_URL, tiny_spec
from tests.trainer.ranks_support import alive, processes_mentioning, rank_pids
from tests.worker.conftest import WorkerProcess, wait_for
from tests.worker.test_async_jobs import rollout_servers
from tests.worker.test_faults import TERMINAL, Service, started_events

WORKER_ENV = {"GRPO_WORKER_DEVICES": "2", "GRPO_DIST_TIMEOUT_S": "120", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def service(pg_url: str, tmp_path: Path, queue_name: str) -> Iterator[Service]:
    settings = build_settings(
        data_dir=tmp_path / "data",
        database_url=pg_url,
        broker_url=REDIS_URL,
        queue_name=f"{queue_name}-{tmp_path.name}",
        lease_seconds=6,
        heartbeat_seconds=1,
    )
    service = Service(settings)
    yield service
    service.client.close()


def two_device_spec(steps: int) -> dict[str, object]:
    spec = tiny_spec(steps=steps)
    spec["resources"] = {"devices": 2}
    spec["checkpoint_interval"] = 2
    return spec


def job_folder(service: Service, job_id: str) -> Path:
    return service.settings.resolved_checkpoint_dir / job_id


def assert_no_rank_left(folder: Path, pids: list[int]) -> None:
    assert len(pids) == 2, "both ranks wrote their pid"
    wait_for(lambda: not any(alive(p) for p in pids), 30, f"ranks {pids} to be gone")
    assert processes_mentioning(str(folder)) == []  # nor the agent


def test_a_two_device_job_succeeds_with_one_metrics_row_per_step(
    service: Service, start_worker: Callable[..., WorkerProcess]
) -> None:
    worker = start_worker(service.settings, **WORKER_ENV)
    job_id = service.submit(two_device_spec(steps=3))
    job = service.wait_status(job_id, TERMINAL, 300, worker)
    assert job["status"] == "succeeded", (job, worker.log_tail())
    assert job["attempt"] == 1
    assert service.metric_steps(job_id) == [1, 2, 3]
    assert [e["attempt"] for e in started_events(service, job_id)] == [1]  # rank 0's on_start
    checkpoints = service.get(f"/v1/jobs/{job_id}/checkpoints")["data"]
    assert [c["step"] for c in checkpoints][-1] == 3  # type: ignore[attr-defined]
    folder = job_folder(service, job_id)
    assert_no_rank_left(folder, rank_pids(folder, 2))


def test_a_rank_killed_mid_run_resumes_from_the_checkpoint_on_the_next_attempt(
    service: Service, start_worker: Callable[..., WorkerProcess]
) -> None:
    steps = 40  # long enough to still run when the kill lands
    worker = start_worker(service.settings, **WORKER_ENV)
    job_id = service.submit(two_device_spec(steps))
    folder = job_folder(service, job_id)

    def checkpointed() -> bool:
        return bool(service.get(f"/v1/jobs/{job_id}/checkpoints")["data"])

    try:
        wait_for(checkpointed, 300, "the first checkpoint")
    except AssertionError:
        raise AssertionError(f"{service.job(job_id)}\n{worker.log_tail()}") from None
    first = rank_pids(folder, 2)
    assert service.job(job_id)["status"] == "running", "the job outlived the kill's window"
    os.kill(first[1], signal.SIGKILL)  # rank 1

    job = service.wait_status(job_id, TERMINAL, 300, worker)
    assert job["status"] == "succeeded", (job, worker.log_tail())
    starts = started_events(service, job_id)
    # One kill, one retry: a third attempt would hide a second failure (its events say which).
    assert job["attempt"] == 2, (service.get(f"/v1/jobs/{job_id}/events"), worker.log_tail())
    assert [e["attempt"] for e in starts] == [1, 2]
    assert starts[1]["data"]["start_step"] >= 2, "resumed from a checkpoint"  # type: ignore[index]
    assert service.metric_steps(job_id) == list(range(1, steps + 1))  # one row per step
    requeued = [e for e in service.events(job_id) if "re-queued" in str(e["message"])]
    assert len(requeued) == 1 and "rank_failed: rank 1 failed" in str(requeued[0]["message"])
    assert not any(alive(p) for p in first)  # the first attempt's ranks
    assert_no_rank_left(folder, rank_pids(folder, 2))  # and the second's


def test_a_two_device_async_job_survives_a_rank_killed_and_its_server_goes_with_the_attempt(
    service: Service, start_worker: Callable[..., WorkerProcess]
) -> None:
    steps = 16
    spec = two_device_spec(steps)
    spec["grpo"]["async"] = {"max_staleness": 1, "server_threads": 1}  # type: ignore[index]
    worker = start_worker(service.settings, **WORKER_ENV)
    job_id = service.submit(spec)
    folder = job_folder(service, job_id)
    wait_for(
        lambda: bool(service.get(f"/v1/jobs/{job_id}/checkpoints")["data"]),
        300,
        "the first checkpoint",
    )
    servers = wait_for(lambda: rollout_servers(worker), 30, "the job's one rollout server")
    assert isinstance(servers, list) and len(servers) == 1  # rank 0's, for both ranks
    first = rank_pids(folder, 2)
    assert service.job(job_id)["status"] == "running", "the job outlived the kill's window"
    os.kill(first[1], signal.SIGKILL)  # rank 1

    job = service.wait_status(job_id, TERMINAL, 300, worker)
    assert job["status"] == "succeeded", (job, worker.log_tail())
    assert job["attempt"] == 2, (service.get(f"/v1/jobs/{job_id}/events"), worker.log_tail())
    assert service.metric_steps(job_id) == list(range(1, steps + 1))  # none lost or doubled
    staleness = service.get(f"/v1/jobs/{job_id}/metrics?names=async/staleness_max")["series"]
    values = [p["value"] for p in staleness["async/staleness_max"]]  # type: ignore[index]
    assert len(values) == steps and max(values) == 1.0
    # The first attempt's server went with its ranks (it exits when its trainer is gone).
    wait_for(lambda: not servers[0].is_running(), 30, "the first attempt's rollout server to exit")
    assert_no_rank_left(folder, rank_pids(folder, 2))
