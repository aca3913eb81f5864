"""Jobs, events and checkpoints as the OpenAI fine-tuning API shows them (app.fine_tuning.schemas).

The names of a job's weights (`ft:...`) are app.fine_tuning.names'."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from app.core.clock import unix, utcnow
from app.core.models import Checkpoint, Job, JobEvent
from app.files import result_files
from app.fine_tuning import service as fine_tuning
from app.fine_tuning.names import base_model, checkpoint_model_name, fine_tuned_model_name
from app.fine_tuning.schemas import (
    FineTuningCheckpointOut,
    FineTuningError,
    FineTuningEventOut,
    FineTuningJobOut,
)
from app.jobs.presenters import job_out, lean_spec
from app.jobs.transitions import TERMINAL, JobStatus

_LEVELS = {"warning": "warn", "error": "error"}
EVENT_PREFIX = "ftevent-"
CHECKPOINT_PREFIX = "ftckpt-"


def openai_job(job: Job, *, trained_tokens: float | None) -> FineTuningJobOut:
    """`trained_tokens`: the job's tokens/trained total (shown once the job has ended)."""
    spec = job.spec
    dataset = spec.get("dataset") or {}
    graders = spec.get("graders") or []
    ended = JobStatus(job.status) in TERMINAL
    native = job_out(job)
    eta = native.progress.eta_s
    hyperparameters = fine_tuning.resolved_hyperparameters(job.openai)
    return FineTuningJobOut(
        id=job.id,
        created_at=unix(job.created_at) or 0,
        error=FineTuningError(code=job.error_code, message=job.error_message or job.error_code)
        if job.error_code
        else None,
        fine_tuned_model=fine_tuned_model_name(job) if job.status == JobStatus.SUCCEEDED else None,
        finished_at=unix(job.finished_at),
        hyperparameters={
            k: hyperparameters[k]
            for k in ("batch_size", "learning_rate_multiplier", "n_epochs")
            if k in hyperparameters
        },
        model=base_model(job),
        organization_id=job.project_id,
        result_files=[result_files.file_id_of(job.id)] if ended else [],
        seed=int(spec.get("seed", 0)),
        status=job.status,
        trained_tokens=int(trained_tokens or 0) if ended else None,
        training_file=dataset.get("file_id"),
        validation_file=dataset.get("validation_file_id"),
        estimated_finish=unix(utcnow() + timedelta(seconds=eta)) if eta is not None else None,
        integrations=[
            {"type": "wandb", "wandb": {k: v for k, v in i.items() if k != "type"}}
            for i in spec.get("integrations") or []
            if i.get("type") == "wandb"
        ],
        metadata=dict(spec.get("metadata") or {}) or None,
        method={
            "type": "reinforcement",
            "reinforcement": {
                "grader": graders[0] if len(graders) == 1 else None,
                "hyperparameters": hyperparameters or None,
                "response_format": (job.openai or {}).get("response_format"),
                # Agent jobs: the tools as OpenAI's function tools (how each runs: the spec).
                **(
                    {"tools": [{"type": "function", "function": t["function"]} for t in tools]}
                    if (tools := spec.get("tools"))
                    else {}
                ),
            },
        },
        grpo_service={
            "status": job.status,
            "step": job.current_step,
            "total_steps": job.total_steps,
            "spec": lean_spec(spec),
        },
    )


def event_from_row(event: JobEvent) -> FineTuningEventOut:
    data: dict[str, Any] = {"type": event.type, "attempt": event.attempt}
    data.update(event.data or {})
    data.pop("path", None)  # a server path, never shown (the native event shows its name)
    return FineTuningEventOut(
        id=f"{EVENT_PREFIX}e{event.id}",
        created_at=unix(event.created_at) or 0,
        level=_LEVELS.get(event.level, "info"),  # type: ignore[arg-type]
        message=event.message,
        type="message",
        data=data,
    )


def event_from_metrics(
    step: int, at: datetime, values: dict[str, Any], total_steps: int
) -> FineTuningEventOut:
    shown = [
        k for k in ("reward/mean", "eval/accuracy", "kl") if isinstance(values.get(k), float | int)
    ]
    summary = ", ".join(f"{k}={values[k]:.4g}" for k in shown)
    return FineTuningEventOut(
        id=f"{EVENT_PREFIX}m{step}",
        created_at=unix(at) or 0,
        level="info",
        message=f"Step {step}/{total_steps}" + (f": {summary}" if summary else ""),
        type="metrics",
        data={"step": step, "total_steps": total_steps, **values},
    )


def openai_checkpoint(
    job: Job, checkpoint: Checkpoint, values: dict[str, Any] | None
) -> FineTuningCheckpointOut:
    metrics = {k: float(v) for k, v in (values or {}).items() if isinstance(v, int | float)}
    return FineTuningCheckpointOut(
        id=f"{CHECKPOINT_PREFIX}{checkpoint.id}",
        created_at=unix(checkpoint.created_at) or 0,
        fine_tuned_model_checkpoint=checkpoint_model_name(job, checkpoint.step),
        fine_tuning_job_id=job.id,
        metrics={"step": float(checkpoint.step), **metrics},
        step_number=checkpoint.step,
    )
