"""Response bodies of /v1/jobs (requests are the job spec itself, jobspec.JobSpec, and the
resume's changes, ResumeRequest); each domain declares its own beside its routes."""

from __future__ import annotations

from datetime import datetime
from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class JobError(BaseModel):
    code: str
    message: str | None


class JobProgress(BaseModel):
    step: int = Field(description="Last completed step.")
    total_steps: int
    last_metrics: dict[str, float] | None = None
    heartbeat_age_s: float | None = Field(
        default=None, description="Seconds since the worker last reported; null when not running."
    )
    eta_s: float | None = Field(default=None, description="Estimated seconds to finish.")


class JobOut(BaseModel):
    object: Literal["job"] = "job"
    id: str
    name: str | None
    status: str
    model: str
    devices: int = Field(
        description="Devices the job trains on (its spec's resources.devices); only a worker "
        "with that many takes it."
    )
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempt: int
    max_attempts: int
    error: JobError | None
    progress: JobProgress
    metadata: dict[str, str]
    spec: dict[str, Any] = Field(description="The resolved job spec, every default filled in.")
    warnings: list[str] = Field(
        default_factory=list,
        description="In the create's answer: what may keep the job from running (no worker of "
        "its size seen lately), each also one of its events. Empty on later reads.",
    )


class JobSummary(JobOut):
    """A job in a list: everything but the inline dataset rows, which can be megabytes."""

    spec: dict[str, Any] = Field(
        description="The resolved job spec, except that inline `dataset.rows` are replaced by "
        "their count, `dataset.row_count`. GET /v1/jobs/{id} has the full spec."
    )


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobSummary]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next page.")


class EventOut(BaseModel):
    object: Literal["job.event"] = "job.event"
    id: int
    job_id: str
    attempt: int
    type: str
    level: str
    message: str
    data: dict[str, Any] | None
    created_at: datetime

    @field_validator("data")
    @classmethod
    def _no_server_path(cls, data: dict[str, Any] | None) -> dict[str, Any] | None:
        # Checkpoint events store the worker's absolute folder; users see its name only.
        if data and isinstance(data.get("path"), str):
            return {**data, "path": PurePath(data["path"]).name}
        return data


class EventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EventOut]
    has_more: bool
    next_after: int | None


class PlanSuggestion(BaseModel):
    change: dict[str, Any] = Field(description="Spec fields (dotted) and the value that fits.")
    description: str
    total: int = Field(description="The plan's total per device under that change (bytes).")


class MemoryPlanOut(BaseModel):
    """Bytes per device of the job on the workers' devices (jobspec.memory_plan)."""

    devices: int
    micro_batch_size: int = Field(
        description="Completions per forward/backward pass the plan is for: the job's number, "
        "or what grpo.micro_batch_size auto chose (the largest power of two that fits)."
    )
    micro_batch_auto: bool = Field(description="Whether the plan chose the micro-batch (auto).")
    parameters: int
    trainable_parameters: int
    per_device: dict[str, int] = Field(
        description="weights, gradients, optimizer, reference, engine (of which kv_cache), "
        "activations at the micro-batch."
    )
    total: int = Field(description="The peak per device.")
    device_memory: int = Field(description="One worker device (GRPO_WORKER_DEVICE_MEMORY_GIB).")
    usable: int = Field(description="The share of it a plan may fill.")
    fits: bool = Field(description="total <= usable; a job that does not fit is refused (422).")
    suggestions: list[PlanSuggestion] = Field(description="Single changes that would fit.")
    host_memory_per_rank: int = Field(
        default=0,
        description="Host memory (bytes) one rank holds at start-up, before its weights move "
        "to the device.",
    )
    host_memory: int = Field(default=0, description="The same for every rank of the job.")


class ValidationResult(BaseModel):
    object: Literal["job.validation"] = "job.validation"
    valid: Literal[True] = True
    spec: dict[str, Any] = Field(description="The resolved spec with every default filled in.")
    warnings: list[str]
    dataset_rows: int | None = Field(description="Rows the dataset resolves to, when known.")
    plan: MemoryPlanOut | None = Field(
        default=None, description="The memory plan; null when the model's config is not known."
    )
    plan_unavailable: str | None = Field(default=None, description="Why `plan` is null.")


class ResumeRequest(BaseModel):
    """The optional body of POST /v1/jobs/{id}/resume: settings a paused job changes as it
    resumes (app.jobs.pausing.RESUME_SETTINGS)."""

    model_config = ConfigDict(extra="forbid")

    set: dict[str, int | float] = Field(
        default_factory=dict,
        max_length=8,
        description="Spec fields (dotted, as in the spec) and their new values; a paused job "
        "may change grpo.learning_rate, grpo.steps, grpo.async.max_staleness, "
        "grpo.async.max_mismatch and grpo.async.max_capped_frac. Any other field is a 422 "
        "naming it. The job resumes from its last checkpoint with the changed spec.",
        examples=[{"grpo.learning_rate": 1e-5, "grpo.async.max_staleness": 1}],
    )


class JobDeleted(BaseModel):
    id: str
    object: Literal["job.deleted"] = "job.deleted"
    deleted: Literal[True] = True
    purge_after: datetime = Field(
        description="From then on the workers purge its checkpoints, samples, metrics and events."
    )
