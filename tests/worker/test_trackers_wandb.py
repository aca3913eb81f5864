"""A job's `integrations: [{type: wandb}]` on a worker in W&B offline mode: the run file wandb
writes holds every step's metrics equal to the database's, the spec as config, the job's run
name and tags, the final checkpoint in the summary, and a clean exit; no network is used."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.settings import Settings
from tests.worker.trackers_support import (
    CATALOG,
    catalog_trainer,
    events,
    make_job,
    read_wandb_run,
    stored_metrics,
    worker_context,
)
from worker.runner import run_job
from worker.trackers.wandb import run_id_of

pytest.importorskip("wandb", reason="wandb is in the cpu/gpu/dev extras")

STEPS = 30


def test_an_offline_wandb_run_holds_every_steps_metrics(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb_dir = tmp_path / "wandb-runs"
    # wandb's own environment says offline too: nothing may reach the network.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    ctx = worker_context(
        settings, tmp_path, wandb_mode="offline", wandb_dir=wandb_dir, tracker_batch_seconds=0.2
    )
    integration = {"type": "wandb", "project": "grpo-tests", "tags": ["ci", "tiny"]}
    job_id = make_job(ctx, [integration], STEPS)

    assert run_job(ctx, job_id, train=catalog_trainer(STEPS)) == "succeeded"

    files = list(wandb_dir.glob(f"wandb/offline-run-*-{run_id_of(job_id)}/run-*.wandb"))
    assert len(files) == 1, list(wandb_dir.rglob("*"))
    run = read_wandb_run(files[0])
    assert (run.run_id, run.project, run.name) == (run_id_of(job_id), "grpo-tests", job_id)
    assert run.tags == ["ci", "tiny"]
    theirs: dict[str, dict[int, float]] = {}
    for step, row in run.history.items():
        for key, value in row.items():
            if not key.startswith("_"):  # wandb's own: _step, _runtime, _timestamp
                theirs.setdefault(key, {})[step] = value
    ours = stored_metrics(ctx, job_id)
    assert sorted(ours) == sorted(CATALOG)
    assert theirs == ours
    assert run.config["grpo.steps"] == str(STEPS)
    assert run.config["model"] == "tiny-random-llama"
    assert run.summary["grpo.final_checkpoint_step"] == str(STEPS)
    assert run.summary["grpo.final_checkpoint"] == f"/v1/jobs/{job_id}/checkpoints/{STEPS}/download"
    assert run.exit_code == 0
    assert events(ctx, job_id, "export_failed") == []


def test_a_worker_with_wandb_disabled_exports_nothing_and_says_so(
    settings: Settings, tmp_path: Path
) -> None:
    """The API refuses such a job; a worker whose settings differ from the API's refuses it
    again, and the job trains anyway."""
    ctx = worker_context(settings, tmp_path, wandb_mode="disabled")
    job_id = make_job(ctx, [{"type": "wandb", "project": "p"}], 3)

    assert run_job(ctx, job_id, train=catalog_trainer(3)) == "succeeded"

    reports = events(ctx, job_id, "export_failed")
    assert [(e.level, e.data) for e in reports] == [
        ("warning", {"tracker": "wandb", "integration": 0})
    ]
    assert reports[0].message == (
        "integrations[0]: this service exports to no Weights & Biases account"
    )
