"""A job's `integrations: [{type: mlflow}]` against a real MLflow tracking server: the worker's
run (worker.runner.run_job, its database callbacks, the exporter thread) leaves the server
holding every step's metrics equal to the database's, the spec as params and the final
checkpoint as a tag; with the server down, or hanging, the job still succeeds, within the
bounded end-of-job wait, and an event says what was not exported."""

from __future__ import annotations

import secrets
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.core.settings import Settings
from tests.conftest import Api, free_port, tiny_spec
from tests.worker.conftest import WorkerProcess, wait_for
from tests.worker.trackers_support import (
    CATALOG,
    MLFLOW,
    NO_MLFLOW,
    catalog_trainer,
    events,
    job_status,
    make_job,
    mlflow_history,
    mlflow_run,
    start_mlflow,
    stored_metrics,
    worker_context,
)
from worker.runner import run_job

STEPS = 60  # x 24 metrics: more than one 1000-metric log-batch call


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server; its tests skip, saying why, where it is not installed."""
    if not MLFLOW.exists():
        pytest.skip(NO_MLFLOW)
    port = free_port()
    proc = start_mlflow(tmp_path_factory.mktemp("mlflow"), port)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# One store: it is not what this tests (test_round_trip runs jobs on both).
@pytest.mark.parametrize("backend", ["postgres"])
def test_the_server_holds_every_steps_metrics_the_spec_and_the_final_checkpoint(
    settings: Settings, tmp_path: Path, mlflow_url: str
) -> None:
    ctx = worker_context(
        settings,
        tmp_path,
        # The trailing slash: the operator's list and the job's URI are compared normalized.
        mlflow_tracking_uris=f"{mlflow_url}/,http://127.0.0.1:1",
        tracker_batch_seconds=0.2,
    )
    experiment = f"exp-{tmp_path.name}"
    integration = {
        "type": "mlflow",
        "experiment": experiment,
        "run_name": "catalog run",
        "tags": {"team": "rl"},
        "tracking_uri": mlflow_url,
    }
    job_id = make_job(ctx, [integration], STEPS)

    assert run_job(ctx, job_id, train=catalog_trainer(STEPS)) == "succeeded"

    ours = stored_metrics(ctx, job_id)
    assert sorted(ours) == sorted(CATALOG)
    assert 3 not in ours["grad_norm"]  # the non-finite value is null in ours, absent there
    run = mlflow_run(mlflow_url, experiment, job_id)
    theirs = mlflow_history(mlflow_url, run["info"]["run_id"], CATALOG)
    assert theirs == ours
    assert sum(len(v) for v in theirs.values()) == STEPS * len(CATALOG) - 1

    info, data = run["info"], run["data"]
    assert info["status"] == "FINISHED"
    assert info["run_name"] == "catalog run"
    tags = {t["key"]: t["value"] for t in data["tags"]}
    assert tags["team"] == "rl"
    assert tags["grpo.job_id"] == job_id
    assert tags["grpo.final_checkpoint_step"] == str(STEPS)
    assert tags["grpo.final_checkpoint"] == f"/v1/jobs/{job_id}/checkpoints/{STEPS}/download"
    params = {p["key"]: p["value"] for p in data["params"]}
    assert params["grpo.steps"] == str(STEPS)
    assert params["model"] == "tiny-random-llama"
    assert params["graders.0.type"] == "numeric_match"
    assert not any(key.startswith("integrations") for key in params)
    assert events(ctx, job_id, "export_failed") == []


# One store: it is not what this tests (test_round_trip runs jobs on both).
@pytest.mark.parametrize("backend", ["postgres"])
def test_a_resumed_job_continues_its_run_and_exports_no_step_twice(
    settings: Settings, tmp_path: Path, mlflow_url: str
) -> None:
    """Attempt 1 stops after step 10 (a worker shutdown); attempt 2 repeats steps 9-10 (the
    last checkpoint was step 8) with other values: the database keeps the first, and so does
    the run, which attempt 2 finds again by the job's tag and finishes."""
    ctx = worker_context(settings, tmp_path, mlflow_tracking_uris=mlflow_url)
    experiment = f"resume-{tmp_path.name}"
    job_id = make_job(ctx, [{"type": "mlflow", "experiment": experiment}], 20)

    def shut_down_after_10(step: int) -> None:
        if step == 10:
            ctx.shutdown.set()

    first = catalog_trainer(20, seed=1, checkpoint_every=8, between_steps=shut_down_after_10)
    assert run_job(ctx, job_id, train=first) == "released"
    assert mlflow_run(mlflow_url, experiment, job_id)["info"]["status"] == "RUNNING"
    ctx.shutdown.clear()

    second = catalog_trainer(20, seed=2, checkpoint_every=8)
    assert run_job(ctx, job_id, train=second) == "succeeded"

    run = mlflow_run(mlflow_url, experiment, job_id)  # one run, asserted there
    assert run["info"]["status"] == "FINISHED"
    assert mlflow_history(mlflow_url, run["info"]["run_id"], CATALOG) == stored_metrics(ctx, job_id)


def test_with_the_server_down_the_job_succeeds_and_an_event_says_what_was_not_exported(
    settings: Settings, tmp_path: Path
) -> None:
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens: every connect is refused
    ctx = worker_context(
        settings,
        tmp_path,
        mlflow_tracking_uris=down,
        tracker_batch_seconds=0.2,
        tracker_retry_seconds=60,  # the end-of-job wait, not this, bounds the job's end
        tracker_flush_seconds=2,
    )
    job_id = make_job(ctx, [{"type": "mlflow", "experiment": "e"}], STEPS)

    started = time.monotonic()
    assert run_job(ctx, job_id, train=catalog_trainer(STEPS)) == "succeeded"
    elapsed = time.monotonic() - started

    assert job_status(ctx, job_id) == "succeeded"
    assert elapsed < 30, f"the job's end waited {elapsed:.1f}s on a tracker that is down"
    reports = events(ctx, job_id, "export_failed")
    assert reports, "no event says what was not exported"
    assert all(e.level == "warning" for e in reports)
    lost_values = sum(int(e.data["values"]) for e in reports if e.data)
    assert lost_values == STEPS * len(CATALOG) - 1  # every finite value of every step
    last = reports[-1].data
    assert last is not None
    assert last["tracker"] == "mlflow"
    assert last["parts"] == ["the final checkpoint reference", "the run's end status"]
    # The events come before the job's end, which is the last event.
    assert events(ctx, job_id)[-1].type == "status"


def test_a_hanging_server_holds_the_job_end_no_longer_than_the_flush_wait(
    settings: Settings, tmp_path: Path
) -> None:
    """A server that accepts connections and never answers: each request would wait for
    its 10 s timeout; the job's end waits tracker_flush_seconds and leaves it behind."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)  # connections complete in the backlog; nothing is ever read
        port = listener.getsockname()[1]
        ctx = worker_context(
            settings,
            tmp_path,
            mlflow_tracking_uris=f"http://127.0.0.1:{port}",
            tracker_flush_seconds=1,
        )
        job_id = make_job(ctx, [{"type": "mlflow", "experiment": "e"}], 5)
        started = time.monotonic()
        assert run_job(ctx, job_id, train=catalog_trainer(5)) == "succeeded"
        elapsed = time.monotonic() - started
    assert elapsed < 9, f"the job's end waited {elapsed:.1f}s on a hanging tracker"
    reports = [e.data for e in events(ctx, job_id, "export_failed") if e.data]
    assert sum(int(r["values"]) for r in reports) == 5 * len(CATALOG) - 1  # all but the inf
    assert "the final checkpoint and run status" in reports[-1]["parts"]


@pytest.mark.parametrize("backend", ["postgres"])  # the deployment's; one real training run
def test_a_job_trained_by_a_real_worker_exports_its_real_metrics(
    api: Api, start_worker: Callable[..., WorkerProcess], tmp_path: Path, mlflow_url: str
) -> None:
    """End to end: submitted over HTTP (the API checks the tracking_uri), trained by a Celery
    worker process with the real trainer, exported from there."""
    api.settings.queue_name = f"{api.settings.queue_name}-{secrets.token_hex(3)}"
    api.settings.mlflow_tracking_uris = mlflow_url
    worker = start_worker(
        api.settings, GRPO_MLFLOW_TRACKING_URIS=mlflow_url, GRPO_TRACKER_BATCH_SECONDS="0.5"
    )
    experiment = f"e2e-{tmp_path.name}"
    integration = {"type": "mlflow", "experiment": experiment, "tracking_uri": mlflow_url}
    spec = tiny_spec(steps=3) | {"integrations": [integration]}
    response = api.client.post("/v1/jobs", json=spec, headers=api.headers)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]

    def finished() -> dict[str, Any] | None:
        body = api.client.get(f"/v1/jobs/{job_id}", headers=api.headers).json()
        return body if body["status"] in ("succeeded", "failed", "cancelled") else None

    try:
        final = wait_for(finished, 300, "the job to finish")
    except AssertionError:
        raise AssertionError(worker.log_tail()) from None
    assert isinstance(final, dict)
    assert final["status"] == "succeeded", (final["error"], worker.log_tail())

    ours = stored_metrics(worker_context(api.settings, tmp_path), job_id)
    # The tiny model scores 0 on every arithmetic prompt: no step has signal, so none runs an
    # update (update/skipped 1, no loss metrics); every step still reports these.
    assert {"reward/mean", "update/skipped", "time/step"} <= set(ours)
    assert all(sorted(steps) == [1, 2, 3] for name, steps in ours.items()), ours
    run = mlflow_run(mlflow_url, experiment, job_id)
    assert run["info"]["status"] == "FINISHED"
    assert mlflow_history(mlflow_url, run["info"]["run_id"], sorted(ours)) == ours
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["grpo.final_checkpoint_step"] == "3"


def test_a_full_queue_turns_values_away_and_says_so(settings: Settings, tmp_path: Path) -> None:
    """While the tracker is down the queue holds at most tracker_queue_size values: the first
    step's fit, the next steps' are turned away at once (never waited on) and reported."""
    down = f"http://127.0.0.1:{free_port()}"
    ctx = worker_context(
        settings,
        tmp_path,
        mlflow_tracking_uris=down,
        tracker_queue_size=len(CATALOG) + 10,
        tracker_batch_seconds=60,  # nothing leaves the queue before the job ends
        tracker_flush_seconds=1,
    )
    job_id = make_job(ctx, [{"type": "mlflow", "experiment": "e"}], 4)

    assert run_job(ctx, job_id, train=catalog_trainer(4)) == "succeeded"

    reports = [e.data for e in events(ctx, job_id, "export_failed") if e.data]
    full = [r for r in reports if str(r["error"]).startswith("the export queue was full")]
    # Steps 2-4 were turned away (step 3 without its non-finite grad_norm), each reported at
    # the step it happened.
    assert [(r["first_step"], r["values"]) for r in full] == [
        (2, len(CATALOG)),
        (3, len(CATALOG) - 1),
        (4, len(CATALOG)),
    ]
    # Step 1 was queued, and lost at the end with the tracker down.
    assert reports[-1]["first_step"] == 1 and reports[-1]["values"] == len(CATALOG)
