"""The MLflow side of bench.metrics_read: its tracking server, seeding a run, sampled reads.

`mlflow server` runs from `.venv-mlflow` (see bench/README.md; mlflow's pins conflict with the
project's). A run's metrics are logged over REST with `runs/log-batch`, 1000 metrics per call,
and read back with MLflow's sampled history (`metrics/get-history-bulk-interval`), which takes
one `metric_key` per GET. The tracker export tests start their server with `start_mlflow` too.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from bench.services import ROOT, wait_for

MLFLOW = ROOT / ".venv-mlflow" / "bin" / "mlflow"
LOG_BATCH_LIMIT = 1000  # log_batch's limit on metrics per call


def start_mlflow(
    backend_url: str, port: int, folder: Path, executable: Path = MLFLOW
) -> subprocess.Popen[bytes]:
    """`mlflow server` on 127.0.0.1:`port` with `backend_url` as its store, its log and artifacts
    in `folder`; returns once its /health answers (killed, and an error raised, if it never
    does). The tests start theirs with this too."""
    log = open(folder / "mlflow.log", "ab")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        [
            str(executable),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            backend_url,
            "--default-artifact-root",
            (folder / "artifacts").as_uri(),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "MLFLOW_TRACKING_URI": ""},
    )

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(
                f"mlflow server exited: {(folder / 'mlflow.log').read_text()[-3000:]}"
            )
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, 180, "mlflow server /health")
    except (AssertionError, RuntimeError, TimeoutError):
        proc.kill()
        proc.wait()
        raise
    return proc


def stop_mlflow(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's whole process group (it forks its workers), if still running."""
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


def mlflow_version(executable: Path = MLFLOW) -> str:
    """What `mlflow --version` prints."""
    return subprocess.run(
        [str(executable), "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()


def log_batch(http: httpx.Client, run_id: str, metrics: list[dict[str, Any]]) -> None:
    """One `runs/log-batch` call."""
    http.post(
        "/api/2.0/mlflow/runs/log-batch", json={"run_id": run_id, "metrics": metrics}
    ).raise_for_status()


def seed_mlflow(http: httpx.Client, steps: list[tuple[int, dict[str, float | None]]]) -> str:
    """An experiment and a run holding `steps`, logged in batches; returns the run's id."""
    experiment = http.post("/api/2.0/mlflow/experiments/create", json={"name": "bench"})
    experiment.raise_for_status()
    run = http.post(
        "/api/2.0/mlflow/runs/create",
        json={"experiment_id": experiment.json()["experiment_id"], "start_time": 0},
    )
    run.raise_for_status()
    run_id = str(run.json()["run"]["info"]["run_id"])
    batch: list[dict[str, Any]] = []
    for step, values in steps:
        for name, value in values.items():
            batch.append({"key": name, "value": value, "timestamp": step, "step": step})
            if len(batch) == LOG_BATCH_LIMIT:
                log_batch(http, run_id, batch)
                batch = []
    if batch:
        log_batch(http, run_id, batch)
    return run_id


def mlflow_path(http: httpx.Client, run_id: str, metric_key: str) -> str:
    """The sampled-history endpoint: under /api/2.0 where this version registers it, else the
    UI's /ajax-api/2.0 route (same handler)."""
    for prefix in ("/api/2.0", "/ajax-api/2.0"):
        path = f"{prefix}/mlflow/metrics/get-history-bulk-interval"
        response = http.get(path, params={"run_ids": run_id, "metric_key": metric_key})
        if response.status_code == 200:
            return path
    raise RuntimeError("no get-history-bulk-interval endpoint answered")


def read_mlflow(http: httpx.Client, path: str, run_id: str, names: list[str], points: int) -> float:
    """One timed read: the sampled history of each of `names`, one GET after another."""
    start = time.perf_counter()
    bodies = []
    for name in names:
        response = http.get(
            path, params={"run_ids": run_id, "metric_key": name, "max_results": points}
        )
        response.raise_for_status()
        bodies.append(response.json())
    elapsed = time.perf_counter() - start
    assert all(len(b["metrics"]) == points for b in bodies), [len(b["metrics"]) for b in bodies]
    return elapsed
