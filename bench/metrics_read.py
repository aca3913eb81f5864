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

Output: a summary on stdout and `bench/results/metrics_read.json`. The MLflow side (its server,
seeding a run, the sampled reads) is in bench.metrics_read_mlflow.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import RESULTS_DIR, load_snapshot, machine_info, write_json
from bench.metrics_read_mlflow import (
    MLFLOW,
    mlflow_path,
    mlflow_version,
    read_mlflow,
    seed_mlflow,
    start_mlflow,
    stop_mlflow,
)
from bench.services import (
    DEFAULT_PG_ADMIN,
    Process,
    create_database,
    drop_database,
    free_port,
    service_env,
    start_api,
)

NAMES = ["reward/mean", "kl", "loss/policy", "entropy", "grad_norm"]
UNLIMITED = {"rate_limit_per_minute": 10_000_000, "rate_limit_burst": 1_000_000}


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


# --- the run --------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    """The command line; an error if MLflow's venv is missing."""
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
    return args


def create_mlflow_database(pg_admin: str) -> str:
    """A fresh, empty database for MLflow's backend store (MLflow creates its own tables)."""
    import psycopg

    name = f"mlflow_bench_{os.getpid()}"
    with psycopg.connect(pg_admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name


def mlflow_backend_url(pg_admin: str, database: str) -> str:
    """`database` on the admin URL's server, as the SQLAlchemy URL MLflow's store takes."""
    return f"{pg_admin.rsplit('/', 1)[0]}/{database}".replace(
        "postgresql://", "postgresql+psycopg2://", 1
    )


@dataclass
class Servers:
    """The two servers under test, each set once started, so that cleanup stops what started."""

    api: Process | None = None
    mlflow: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        """Stop the servers that started, the API first."""
        if self.api is not None:
            self.api.stop()
        if self.mlflow is not None:
            stop_mlflow(self.mlflow)


def alternate_reads(
    read_ours_once: Callable[[], float],
    read_mlflow_once: Callable[[], float],
    warmup: int,
    reads: int,
) -> tuple[list[float], list[float]]:
    """`warmup` untimed reads of each side, then `reads` timed ones, alternating so that both
    sides see the same machine load; returns (ours, MLflow) in seconds."""
    for _ in range(warmup):
        read_ours_once()
        read_mlflow_once()
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(reads):
        ours.append(read_ours_once())
        theirs.append(read_mlflow_once())
    return ours, theirs


def record_reads(
    result: dict[str, Any],
    ours: list[float],
    theirs: list[float],
    api_rss_before: int,
    api_pid: int,
    mlflow_pid: int,
) -> None:
    """The reads' summaries, the servers' memory and the MLflow / ours ratios into `result`."""
    result["ours"] = {
        **summary(ours),
        "reads_s": ours,
        "api_rss_before_reads_bytes": api_rss_before,
        "api_rss_after_reads_bytes": rss_of_tree(api_pid),
    }
    result["mlflow"] |= {
        **summary(theirs),
        "reads_s": theirs,
        "server_rss_after_reads_bytes": rss_of_tree(mlflow_pid),
    }
    result["ratio_mlflow_over_ours"] = {
        "p50": result["mlflow"]["p50_ms"] / result["ours"]["p50_ms"],
        "p95": result["mlflow"]["p95_ms"] / result["ours"]["p95_ms"],
    }


def compare(
    args: argparse.Namespace,
    result: dict[str, Any],
    steps: list[tuple[int, dict[str, float | None]]],
    folder: Path,
    ours_url: str,
    mlflow_db: str,
    servers: Servers,
) -> None:
    """Seed both sides, start their servers (into `servers`), time the reads into `result`."""
    started = time.perf_counter()
    key, job_id = seed_ours(ours_url, steps)
    result["ours_seed_s"] = time.perf_counter() - started

    port = free_port()
    env = service_env(ours_url, "", "bench-metrics", folder / "data", **UNLIMITED)
    api = servers.api = start_api(env, port, workers=1, log_path=folder / "api.log")
    mlflow_port = free_port()
    backend = mlflow_backend_url(args.pg_admin, mlflow_db)
    mlflow = servers.mlflow = start_mlflow(backend, mlflow_port, folder)
    result["mlflow"] = {"version": mlflow_version(), "backend_store": "postgresql"}

    ours_http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    mlflow_http = httpx.Client(base_url=f"http://127.0.0.1:{mlflow_port}", timeout=600)
    started = time.perf_counter()
    run_id = seed_mlflow(mlflow_http, steps)
    result["mlflow_seed_s"] = time.perf_counter() - started
    path = mlflow_path(mlflow_http, run_id, NAMES[0])
    result["mlflow"]["endpoint"] = path

    api_rss_before = rss_of_tree(api.pid)
    ours, theirs = alternate_reads(
        lambda: read_ours(ours_http, job_id, args.points, args.steps),
        lambda: read_mlflow(mlflow_http, path, run_id, NAMES, args.points),
        args.warmup,
        args.reads,
    )
    record_reads(result, ours, theirs, api_rss_before, api.pid, mlflow.pid)
    result["before_rollups"] = [
        before_read(ours_url, job_id, args.points) for _ in range(args.before)
    ]
    result["load_after"] = load_snapshot()


def print_summary(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The run's figures on stdout."""
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


def main() -> int:
    """Seed and read both sides, clean up, write the JSON and print the figures."""
    args = parse_args()
    result: dict[str, Any] = {
        "benchmark": "metrics_read",
        "machine": machine_info(),
        "load_before": load_snapshot(),
        "config": {"steps": args.steps, "metrics": NAMES, "points": args.points},
    }
    steps = make_steps(args.steps)
    folder = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    ours_db, ours_url = create_database(args.pg_admin, "grpo_bench_metrics")
    mlflow_db = create_mlflow_database(args.pg_admin)
    servers = Servers()
    try:
        compare(args, result, steps, folder, ours_url, mlflow_db, servers)
    finally:
        servers.stop()
        drop_database(args.pg_admin, ours_db)
        drop_database(args.pg_admin, mlflow_db)
        shutil.rmtree(folder, ignore_errors=True)
    write_json(args.out, result)
    print_summary(args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
