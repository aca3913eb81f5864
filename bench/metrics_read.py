"""Reading a long job's metrics: GET /v1/jobs/{id}/metrics vs an MLflow tracking server.

    python -m bench.metrics_read              # 100,000 steps x 5 metrics, 500 points, 20 reads
    python -m bench.metrics_read --steps 20000 --reads 10

The same data on both sides, each on its own fresh database of the local Postgres:

* ours: `grpo api` (uvicorn, 1 process) on a migrated database; one job whose steps are
  inserted with the bulk repository insert (`app.progress.metrics_repository.add_many`, the rollups
  included). A read is one GET with the 5 names and `max_points=500`.
* MLflow: `mlflow server` from `.venv-mlflow` (see bench/README.md) with a Postgres backend
  store; one run whose metrics are logged over REST with `runs/log-batch`, 1000 metrics per
  call. A read is MLflow's sampled history, `metrics/get-history-bulk-interval` with
  `max_results=500`, once per metric (it takes one `metric_key`): 5 GETs, one after another.

Reads alternate (ours, MLflow, ours, ...) after a few warm-up reads of each, so both see the
same machine load. `--before N` also times N reads the way the endpoint worked before rollups
(every row loaded as an ORM object, downsampled in Python), in this process.

Output: a summary on stdout and `bench/results/metrics_read.json`.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import RESULTS_DIR, load_snapshot, machine_info, write_json
from bench.services import (
    DEFAULT_PG_ADMIN,
    ROOT,
    create_database,
    drop_database,
    free_port,
    service_env,
    start_api,
    wait_for,
)

NAMES = ["reward/mean", "kl", "loss/policy", "entropy", "grad_norm"]
UNLIMITED = {"rate_limit_per_minute": 10_000_000, "rate_limit_burst": 1_000_000}
MLFLOW = ROOT / ".venv-mlflow" / "bin" / "mlflow"


def make_steps(steps: int, seed: int = 0) -> list[tuple[int, dict[str, float | None]]]:
    rng = random.Random(seed)
    return [
        (
            step,
            {
                "reward/mean": rng.random(),
                "kl": rng.random() / 100,
                "loss/policy": rng.gauss(0, 1),
                "entropy": rng.uniform(0, 2),
                "grad_norm": rng.uniform(0, 10),
            },
        )
        for step in range(1, steps + 1)
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summary(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "p50_ms": statistics.median(ms),
        "p95_ms": percentile(ms, 0.95),
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


def rss_of_tree(pid: int) -> int:
    import psutil

    proc = psutil.Process(pid)
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


# --- ours -----------------------------------------------------------------------------------


def seed_ours(
    database_url: str, steps: list[tuple[int, dict[str, float | None]]]
) -> tuple[str, str]:
    """A project with a key, a finished job, and its steps (bulk insert with rollups), through
    the service's own code; returns (API key, job id)."""
    from app.core.clock import utcnow
    from app.core.db import make_engine, make_session_factory, session_scope
    from app.core.ids import new_id
    from app.core.models import Job
    from app.jobs import repository as jobs_repo
    from app.progress import metrics_repository as metrics_repo
    from app.sessions.service import create_key

    engine = make_engine(database_url)
    sessions = make_session_factory(engine)
    try:
        with session_scope(sessions) as session:
            created = create_key(session, "bench", "bench")
            key = created.plaintext
            now = utcnow()
            job = Job(
                id=new_id("job"),
                project_id=created.project_id,
                name="metrics-read",
                status="succeeded",
                spec={"model": "tiny-random-llama", "metadata": {}},
                attempt=1,
                max_attempts=3,
                queue="bench",
                created_at=now,
                updated_at=now,
                total_steps=len(steps),
                current_step=len(steps),
            )
            jobs_repo.add(session, job=job)
            job_id = job.id
        for start in range(0, len(steps), 10_000):  # one transaction per 10,000 steps
            with session_scope(sessions) as session:
                metrics_repo.add_many(
                    session,
                    job_id=job_id,
                    attempt=1,
                    points=steps[start : start + 10_000],
                    now=utcnow(),
                )
        with engine.connect() as conn:  # fresh statistics, as autovacuum would have by now
            conn.exec_driver_sql("ANALYZE")
    finally:
        engine.dispose()
    return key, job_id


def read_ours(http: httpx.Client, job_id: str, points: int, steps: int) -> float:
    params: list[tuple[str, str | int | float | bool | None]] = [("names", n) for n in NAMES]
    params.append(("max_points", points))
    start = time.perf_counter()
    response = http.get(f"/v1/jobs/{job_id}/metrics", params=params)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    body = response.json()
    assert body["steps"] == steps, body["steps"]
    assert all(0 < len(body["series"][n]) <= points for n in NAMES)
    return elapsed


def before_read(database_url: str, job_id: str, points: int) -> dict[str, float]:
    """The endpoint before rollups, reproduced here (its code is gone from app/): every row as
    an ORM object, then buckets of consecutive points in Python."""
    from sqlalchemy import select

    from app.core.db import make_engine, make_session_factory, session_scope
    from app.core.models import JobMetric

    engine = make_engine(database_url)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    buckets = 0
    try:
        with session_scope(make_session_factory(engine)) as session:
            query = select(JobMetric).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
            rows = list(session.scalars(query))
            for name in NAMES:
                pts = [(r.step, float(v)) for r in rows if (v := r.values.get(name)) is not None]
                size = math.ceil(len(pts) / points)
                for i in range(0, len(pts), size):
                    bucket = [v for _, v in pts[i : i + size]]
                    _ = (sum(bucket) / len(bucket), min(bucket), max(bucket), len(bucket))
                    buckets += 1
    finally:
        engine.dispose()
    elapsed = time.perf_counter() - start
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    return {"seconds": elapsed, "peak_rss_growth_bytes": grown, "buckets": buckets}


# --- MLflow ---------------------------------------------------------------------------------


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


def seed_mlflow(http: httpx.Client, steps: list[tuple[int, dict[str, float | None]]]) -> str:
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
            if len(batch) == 1000:  # log_batch's limit
                http.post(
                    "/api/2.0/mlflow/runs/log-batch", json={"run_id": run_id, "metrics": batch}
                ).raise_for_status()
                batch = []
    if batch:
        http.post(
            "/api/2.0/mlflow/runs/log-batch", json={"run_id": run_id, "metrics": batch}
        ).raise_for_status()
    return run_id


def mlflow_path(http: httpx.Client, run_id: str) -> str:
    """The sampled-history endpoint: under /api/2.0 where this version registers it, else the
    UI's /ajax-api/2.0 route (same handler)."""
    for prefix in ("/api/2.0", "/ajax-api/2.0"):
        path = f"{prefix}/mlflow/metrics/get-history-bulk-interval"
        response = http.get(path, params={"run_ids": run_id, "metric_key": NAMES[0]})
        if response.status_code == 200:
            return path
    raise RuntimeError("no get-history-bulk-interval endpoint answered")


def read_mlflow(http: httpx.Client, path: str, run_id: str, points: int) -> float:
    start = time.perf_counter()
    bodies = []
    for name in NAMES:
        response = http.get(
            path, params={"run_ids": run_id, "metric_key": name, "max_results": points}
        )
        response.raise_for_status()
        bodies.append(response.json())
    elapsed = time.perf_counter() - start
    assert all(len(b["metrics"]) == points for b in bodies), [len(b["metrics"]) for b in bodies]
    return elapsed


# --- the run --------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--points", type=int, default=500, help="max_points / max_results")
    parser.add_argument("--reads", type=int, default=20, help="timed reads per side")
    parser.add_argument("--warmup", type=int, default=3, help="untimed reads per side first")
    parser.add_argument("--before", type=int, default=1, help="reads the pre-rollup way")
    parser.add_argument("--pg-admin", default=DEFAULT_PG_ADMIN)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "metrics_read.json")
    args = parser.parse_args()
    if not MLFLOW.exists():
        parser.error(f"{MLFLOW} not found: install MLflow into .venv-mlflow (bench/README.md)")

    result: dict[str, Any] = {
        "benchmark": "metrics_read",
        "machine": machine_info(),
        "load_before": load_snapshot(),
        "config": {"steps": args.steps, "metrics": NAMES, "points": args.points},
    }
    steps = make_steps(args.steps)
    folder = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    ours_db, ours_url = create_database(args.pg_admin, "grpo_bench_metrics")
    mlflow_db = f"mlflow_bench_{os.getpid()}"
    import psycopg

    with psycopg.connect(args.pg_admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{mlflow_db}"')
    api = mlflow = None
    try:
        started = time.perf_counter()
        key, job_id = seed_ours(ours_url, steps)
        result["ours_seed_s"] = time.perf_counter() - started

        port = free_port()
        env = service_env(ours_url, "", "bench-metrics", folder / "data", **UNLIMITED)
        api = start_api(env, port, workers=1, log_path=folder / "api.log")
        mlflow_port = free_port()
        backend = f"{args.pg_admin.rsplit('/', 1)[0]}/{mlflow_db}".replace(
            "postgresql://", "postgresql+psycopg2://", 1
        )
        mlflow = start_mlflow(backend, mlflow_port, folder)
        mlflow_version = subprocess.run(
            [str(MLFLOW), "--version"], capture_output=True, text=True, check=True
        ).stdout.strip()
        result["mlflow"] = {"version": mlflow_version, "backend_store": "postgresql"}

        ours_http = httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        mlflow_http = httpx.Client(base_url=f"http://127.0.0.1:{mlflow_port}", timeout=600)
        started = time.perf_counter()
        run_id = seed_mlflow(mlflow_http, steps)
        result["mlflow_seed_s"] = time.perf_counter() - started
        path = mlflow_path(mlflow_http, run_id)
        result["mlflow"]["endpoint"] = path

        rss_api_before = rss_of_tree(api.pid)
        for _ in range(args.warmup):
            read_ours(ours_http, job_id, args.points, args.steps)
            read_mlflow(mlflow_http, path, run_id, args.points)
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(args.reads):
            ours.append(read_ours(ours_http, job_id, args.points, args.steps))
            theirs.append(read_mlflow(mlflow_http, path, run_id, args.points))
        result["ours"] = {
            **summary(ours),
            "reads_s": ours,
            "api_rss_before_reads_bytes": rss_api_before,
            "api_rss_after_reads_bytes": rss_of_tree(api.pid),
        }
        result["mlflow"] |= {
            **summary(theirs),
            "reads_s": theirs,
            "server_rss_after_reads_bytes": rss_of_tree(mlflow.pid),
        }
        result["ratio_mlflow_over_ours"] = {
            "p50": result["mlflow"]["p50_ms"] / result["ours"]["p50_ms"],
            "p95": result["mlflow"]["p95_ms"] / result["ours"]["p95_ms"],
        }
        result["before_rollups"] = [
            before_read(ours_url, job_id, args.points) for _ in range(args.before)
        ]
        result["load_after"] = load_snapshot()
    finally:
        if api is not None:
            api.stop()
        if mlflow is not None and mlflow.poll() is None:
            os.killpg(mlflow.pid, 15)
            mlflow.wait(timeout=60)
        drop_database(args.pg_admin, ours_db)
        drop_database(args.pg_admin, mlflow_db)
        shutil.rmtree(folder, ignore_errors=True)
    write_json(args.out, result)
    o, m = result["ours"], result["mlflow"]
    print(f"{args.steps} steps x {len(NAMES)} metrics, {args.points} points, {args.reads} reads")
    print(f"ours   p50 {o['p50_ms']:.1f} ms  p95 {o['p95_ms']:.1f} ms")
    print(f"mlflow p50 {m['p50_ms']:.1f} ms  p95 {m['p95_ms']:.1f} ms  ({m['endpoint']} x5)")
    ratio = result["ratio_mlflow_over_ours"]
    print(f"mlflow / ours: p50 {ratio['p50']:.1f}x  p95 {ratio['p95']:.1f}x")
    for b in result["before_rollups"]:
        print(
            f"before rollups: {b['seconds']:.2f} s, +{b['peak_rss_growth_bytes'] / 2**20:.0f} MiB"
        )
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
