"""Issue 4 acceptance: real Postgres, real Redis, real `grpo worker` processes, real faults.

Each test runs a small tiny-model job and injects one fault: kill -9, a duplicate message,
a cancel, SIGTERM, a Redis restart, a Postgres restart. The job must end where it should, with
exactly one metrics row per step.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from app.core.queue import CeleryDispatcher
from app.core.settings import Settings, build_settings
from app.main import create_app
from grpo_cli import db as migrations
from tests.conftest import (
    REDIS_URL,
    free_port,
    new_project_key,
    start_private_redis,
    tiny_spec,
)
from tests.worker.conftest import WorkerProcess, wait_for

TERMINAL = ("succeeded", "failed", "cancelled")


class Service:
    """The API in-process (TestClient) on its own Postgres database and Redis queue."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.key, _ = new_project_key(settings)
        self.client = TestClient(create_app(settings))
        self.headers = {"Authorization": f"Bearer {self.key}"}

    def submit(self, spec: dict[str, object]) -> str:
        response = self.client.post("/v1/jobs", json=spec, headers=self.headers)
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def job(self, job_id: str) -> dict[str, object]:
        return dict(self.client.get(f"/v1/jobs/{job_id}", headers=self.headers).json())

    def get(self, path: str) -> dict[str, object]:
        return dict(self.client.get(path, headers=self.headers).json())

    def metric_steps(self, job_id: str) -> list[int]:
        series = self.get(f"/v1/jobs/{job_id}/metrics?names=reward/mean")["series"]
        return [p["step"] for p in series["reward/mean"]]  # type: ignore[index]

    def events(self, job_id: str) -> list[dict[str, object]]:
        return list(self.get(f"/v1/jobs/{job_id}/events?limit=1000")["data"])  # type: ignore[arg-type]

    def wait_status(
        self, job_id: str, statuses: tuple[str, ...], timeout: float, *workers: WorkerProcess
    ) -> dict[str, object]:
        try:
            return wait_for(  # type: ignore[return-value]
                lambda: (j := self.job(job_id))["status"] in statuses and j, timeout, f"{statuses}"
            )
        except AssertionError:
            logs = "\n---\n".join(w.log_tail() for w in workers)
            raise AssertionError(f"job {self.job(job_id)}\nworker logs:\n{logs}") from None

    def wait_step(self, job_id: str, step: int, timeout: float, *workers: WorkerProcess) -> None:
        try:
            wait_for(
                lambda: int(self.job(job_id)["progress"]["step"]) >= step, timeout, f"step {step}"
            )  # type: ignore[index]
        except AssertionError:
            logs = "\n---\n".join(w.log_tail() for w in workers)
            raise AssertionError(f"job {self.job(job_id)}\nworker logs:\n{logs}") from None


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


# Fault tests need a job that is still running when the fault lands: tiny steps take ~0.2 s on
# a quiet machine, so jobs are long enough to outlast the polling between "step k" and the fault.
LONG = 40


def job_spec(steps: int = LONG, **grpo: object) -> dict[str, object]:
    spec = tiny_spec(steps=steps, **grpo)
    spec["checkpoint_interval"] = 2
    return spec


def started_events(service: Service, job_id: str) -> list[dict[str, object]]:
    return [e for e in service.events(job_id) if e["type"] == "started"]


def outcomes(job_id: str, *workers: WorkerProcess) -> list[str]:
    """What each delivery of `job_id` came to, from the line the worker logs per delivery."""
    line = re.compile(rf"job {re.escape(job_id)}: (\w+)$", re.MULTILINE)
    return sorted(o for w in workers for o in line.findall(w.log_path.read_text(errors="replace")))


def wait_for_log(worker: WorkerProcess, what: str, *phrases: str, timeout: float = 60) -> None:
    """Wait until the worker's log shows one of `phrases` (it noticed a fault)."""
    try:
        wait_for(lambda: any(p in worker.log_tail(50_000) for p in phrases), timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nworker log:\n{worker.log_tail()}") from None


def test_vllm_job_end_to_end_with_live_stream(
    service: Service, start_worker: Callable[..., WorkerProcess]
) -> None:
    spec = job_spec(steps=4, kl={"estimator": "k3_unbiased", "beta": 0.05})
    spec["rollout"] = {"engine": "vllm"}  # KV cache sized to the batch
    worker = start_worker(service.settings)
    job_id = service.submit(spec)
    metrics_steps: list[int] = []
    with service.client.stream(
        "GET", f"/v1/jobs/{job_id}/stream", headers=service.headers
    ) as response:
        event = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
                if event == "end":
                    break
            elif line.startswith("data: ") and event == "metrics":
                metrics_steps.append(json.loads(line[6:])["step"])
    job = service.wait_status(job_id, TERMINAL, 30, worker)
    assert job["status"] == "succeeded", job
    assert metrics_steps == [1, 2, 3, 4]  # every step, in order, live
    rows = service.get(f"/v1/jobs/{job_id}/metrics")
    assert rows["steps"] == 4
    assert {"reward/mean", "kl", "kl_k3", "logprob_diff/engine_vs_trainer"} <= set(
        rows["available"]
    )  # type: ignore[arg-type]
    checkpoints = service.get(f"/v1/jobs/{job_id}/checkpoints")["data"]
    assert [c["step"] for c in checkpoints][-1] == 4  # type: ignore[index]
    # The API names the folder only (no server path); it lives in the job's checkpoint store.
    folder = service.settings.resolved_checkpoint_dir / job_id / checkpoints[-1]["path"]  # type: ignore[index]
    assert folder.is_dir()
    samples = service.get(f"/v1/jobs/{job_id}/samples")["data"]
    assert samples and samples[0]["groups"][0]["completions"]  # type: ignore[index]


def test_kill_9_mid_run_resumes_from_the_checkpoint(
    service: Service, start_worker: Callable[..., WorkerProcess]
) -> None:
    first = start_worker(service.settings)
    job_id = service.submit(job_spec())
    service.wait_step(job_id, 3, 240, first)
    first.stop(signal.SIGKILL)
    second = start_worker(service.settings)
    job = service.wait_status(job_id, TERMINAL, 300, second)
    assert job["status"] == "succeeded", (job, second.log_tail())
    assert job["attempt"] == 2
    starts = started_events(service, job_id)
    assert [e["attempt"] for e in starts] == [1, 2]
    resumed_at = starts[1]["data"]["start_step"]  # type: ignore[index]
    assert resumed_at >= 2, "resumed from a checkpoint, not from step 0"
    assert service.metric_steps(job_id) == list(range(1, LONG + 1))  # one row per step


def test_duplicate_messages_train_once(
    service: Service, start_worker: Callable[..., WorkerProcess]
) -> None:
    workers = [start_worker(service.settings), start_worker(service.settings)]
    job_id = service.submit(job_spec(steps=3))
    CeleryDispatcher(service.settings).send(job_id)  # the same message, delivered again
    CeleryDispatcher(service.settings).send(job_id)
    job = service.wait_status(job_id, TERMINAL, 240, *workers)
    assert job["status"] == "succeeded"
    assert job["attempt"] == 1
    running = [e for e in service.events(job_id) if (e["data"] or {}).get("to") == "running"]  # type: ignore[union-attr]
    assert len(running) == 1
    assert service.metric_steps(job_id) == [1, 2, 3]
    # Every one of the three deliveries was consumed: one trained, the duplicates did nothing.
    wait_for(lambda: len(outcomes(job_id, *workers)) >= 3, 60, "all three deliveries")
    assert outcomes(job_id, *workers) == ["not_claimed", "not_claimed", "succeeded"]


def test_cancel_running_job_stops_within_a_step(
    service: Service, start_worker: Callable[..., WorkerProcess]
) -> None:
    worker = start_worker(service.settings)
    job_id = service.submit(job_spec(steps=1000))
    service.wait_step(job_id, 1, 240, worker)
    response = service.client.post(f"/v1/jobs/{job_id}/cancel", headers=service.headers)
    assert response.json()["status"] == "cancelling"
    step_at_cancel = int(response.json()["progress"]["step"])
    job = service.wait_status(job_id, TERMINAL, 120, worker)
    assert job["status"] == "cancelled"
    assert int(job["progress"]["step"]) <= step_at_cancel + 1  # type: ignore[call-overload]
    checkpoints = service.get(f"/v1/jobs/{job_id}/checkpoints")["data"]
    assert checkpoints, "the last checkpoint is kept"


def test_cancelled_queued_job_never_starts(
    service: Service, start_worker: Callable[..., WorkerProcess]
) -> None:
    job_id = service.submit(job_spec(steps=2))
    service.client.post(f"/v1/jobs/{job_id}/cancel", headers=service.headers)
    worker = start_worker(service.settings)
    other = service.submit(job_spec(steps=1))  # proves the worker consumed the queue
    service.wait_status(other, TERMINAL, 240, worker)
    assert service.job(job_id)["status"] == "cancelled"
    assert service.job(job_id)["attempt"] == 0
    assert not started_events(service, job_id)


def test_sigterm_checkpoints_and_hands_the_job_over(
    service: Service, start_worker: Callable[..., WorkerProcess]
) -> None:
    first = start_worker(service.settings)
    job_id = service.submit(job_spec())
    service.wait_step(job_id, 2, 240, first)
    # A warm shutdown: the worker exits by itself (status 0) once the job is handed over,
    # well before the grace period after which stop() would kill it.
    assert first.stop(signal.SIGTERM, timeout=120) == 0, first.log_tail()
    handed = service.job(job_id)
    assert handed["status"] == "queued", (handed, first.log_tail())
    second = start_worker(service.settings)
    job = service.wait_status(job_id, TERMINAL, 300, second)
    assert job["status"] == "succeeded"
    starts = started_events(service, job_id)
    assert starts[1]["data"]["start_step"] >= 2  # type: ignore[index]
    assert service.metric_steps(job_id) == list(range(1, LONG + 1))


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_redis_restart_during_a_run(
    pg_url: str, tmp_path: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    port = free_port()
    data = tmp_path / "redis"
    data.mkdir()

    def start_redis() -> subprocess.Popen[bytes]:
        return start_private_redis(port, data_dir=data)

    server = start_redis()
    settings = build_settings(
        data_dir=tmp_path / "data",
        database_url=pg_url,
        broker_url=f"redis://127.0.0.1:{port}/0",
        lease_seconds=30,
        heartbeat_seconds=1,
    )
    service = Service(settings)
    try:
        worker = start_worker(settings)
        job_id = service.submit(job_spec(steps=60))
        service.wait_step(job_id, 1, 240, worker)
        redis.Redis(port=port).shutdown(nosave=True)
        server.wait()
        wait_for(lambda: service.client.get("/readyz").status_code == 503, 10, "readyz 503")
        # Keep Redis down until the worker has seen the broker go away.
        wait_for_log(
            worker,
            "the worker to lose the broker",
            "Connection to broker lost",
            "Cannot connect to redis",
        )
        server = start_redis()
        job = service.wait_status(job_id, TERMINAL, 300, worker)
        assert job["status"] == "succeeded", job
        assert job["attempt"] == 1
        assert service.metric_steps(job_id) == list(range(1, 61))
    finally:
        service.client.close()
        server.kill()


def _pg_cluster_tools() -> bool:
    return shutil.which("pg_createcluster") is not None and Path("/etc/postgresql").is_dir()


@pytest.mark.skipif(not _pg_cluster_tools(), reason="needs Debian's postgresql-common")
def test_postgres_restart_during_a_run(
    tmp_path: Path, start_worker: Callable[..., WorkerProcess]
) -> None:
    version = sorted(p.name for p in Path("/etc/postgresql").iterdir())[0]
    cluster = f"grpotest{free_port()}"
    port = free_port()
    subprocess.run(
        ["pg_createcluster", version, cluster, "-p", str(port), "--start", "--", "--auth=trust"],
        check=True,
        capture_output=True,
    )
    ctl = ["pg_ctlcluster", "--skip-systemctl-redirect", version, cluster]
    try:
        admin = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        import psycopg

        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("CREATE DATABASE grpo")
        url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/grpo"
        migrations.upgrade(url)
        settings = build_settings(
            data_dir=tmp_path / "data",
            database_url=url,
            broker_url=REDIS_URL,
            queue_name=f"pgrestart-{port}",
            lease_seconds=30,
            heartbeat_seconds=1,
        )
        service = Service(settings)
        worker = start_worker(settings)
        job_id = service.submit(job_spec(steps=60))
        service.wait_step(job_id, 1, 240, worker)
        subprocess.run([*ctl, "stop", "-m", "immediate"], check=True)
        down = service.client.get("/v1/jobs", headers=service.headers)
        assert down.status_code == 503
        assert down.json()["error"]["type"] == "service_unavailable"
        # Keep Postgres down until the worker's own writes have failed at least once.
        wait_for_log(
            worker,
            "the worker to find the database down",
            "database unavailable",
            "heartbeat of job",
        )
        subprocess.run([*ctl, "start"], check=True)
        job = service.wait_status(job_id, TERMINAL, 300, worker)
        assert job["status"] == "succeeded", job
        assert service.metric_steps(job_id) == list(range(1, 61))
        service.client.close()
    finally:
        subprocess.run(["pg_dropcluster", version, cluster, "--stop"], capture_output=True)
