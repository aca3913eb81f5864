"""Response bodies of the HTTP API (requests are the job spec itself, trainer.config.JobSpec)."""

from __future__ import annotations

from datetime import datetime
from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator


class ErrorBody(BaseModel):
    type: str = Field(description="Machine-readable error class.")
    message: str = Field(description="What went wrong, for people.")
    param: str | None = Field(default=None, description="Path of the offending field, if any.")
    code: str | None = Field(
        default=None,
        description="The specific reason (invalid_value, quota_exceeded, invalid_state, ...).",
    )
    details: list[Any] | None = Field(default=None, description="Every problem found, if several.")


class ErrorResponse(BaseModel):
    error: ErrorBody


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


class ValidationResult(BaseModel):
    object: Literal["job.validation"] = "job.validation"
    valid: Literal[True] = True
    spec: dict[str, Any] = Field(description="The resolved spec with every default filled in.")
    warnings: list[str]
    dataset_rows: int | None = Field(description="Rows the dataset resolves to, when known.")


class FileOut(BaseModel):
    """OpenAI's file object (openai-python's FileObject), plus the row count."""

    object: Literal["file"] = "file"
    id: str
    bytes: int
    created_at: int = Field(description="Unix seconds.")
    filename: str
    purpose: str = Field(
        description="`train` or `fine-tune` (uploads), `fine-tune-results` (a job's metrics)."
    )
    status: Literal["processed"] = Field(
        default="processed", description="Every row is validated at upload: always processed."
    )
    expires_at: int | None = None
    status_details: str | None = None
    row_count: int = Field(description="Rows of an upload; steps of a result file.")


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileOut]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: Literal[True] = True


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    status: Literal["ok", "unavailable"]
    database: str
    broker: str


class MetricPoint(BaseModel):
    step: int = Field(description="Last step of the bucket that has a value.")
    value: float = Field(description="Mean over the bucket.")
    min: float
    max: float
    count: int = Field(description="Values in the bucket (1 without downsampling).")


class MetricSeries(BaseModel):
    object: Literal["job.metrics"] = "job.metrics"
    job_id: str
    steps: int = Field(description="Steps with metrics in the selected range.")
    available: list[str] = Field(description="Every metric name the job has recorded.")
    series: dict[str, list[MetricPoint]]
    bucket_steps: int = Field(
        description="Steps per bucket: with `max_points`, bucket k holds the steps "
        "(k-1)*bucket_steps < step <= k*bucket_steps of the range; 1 without downsampling."
    )
    next_step_from: int | None = Field(
        default=None,
        description="Without `max_points` only: the range has more steps than `limit`; pass "
        "this as `step_from` for the next page. Null when this page is the last.",
    )


class SampleCompletion(BaseModel):
    text: str
    reward: float
    rewards: dict[str, float]
    advantage: float
    num_tokens: int
    finish_reason: str


class SampleGroup(BaseModel):
    prompt: str
    answer: str | None
    completions: list[SampleCompletion]


class StepSamples(BaseModel):
    object: Literal["job.samples"] = "job.samples"
    step: int
    attempt: int
    groups: list[SampleGroup]


class SampleList(BaseModel):
    object: Literal["list"] = "list"
    data: list[StepSamples]
    has_more: bool
    next_after: int | None


class CheckpointOut(BaseModel):
    object: Literal["job.checkpoint"] = "job.checkpoint"
    step: int
    attempt: int
    path: str = Field(
        description="The checkpoint's folder name in the service's checkpoint store "
        "(checkpoint-000010); never a path on the server."
    )
    created_at: datetime
    size_bytes: int | None = Field(
        default=None,
        description="The checkpoint folder's size when it was saved (null for older records).",
    )

    @field_validator("path")
    @classmethod
    def _folder_name(cls, path: str) -> str:
        # Rows store the worker's absolute folder, which tells a tenant about the server.
        return PurePath(path).name


class CheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CheckpointOut]


class JobDeleted(BaseModel):
    id: str
    object: Literal["job.deleted"] = "job.deleted"
    deleted: Literal[True] = True
    purge_after: datetime = Field(
        description="From then on the workers purge its checkpoints, samples, metrics and events."
    )


class JobUsage(BaseModel):
    job_id: str
    checkpoint_bytes: int
    checkpoints: int


class CheckpointQuotaOut(BaseModel):
    used_bytes: int = Field(
        description="Bytes counted against the limit: `checkpoint_bytes` plus "
        "`pending_purge_bytes`."
    )
    pending_purge_bytes: int = Field(
        description="Checkpoints of deleted jobs, still stored until the workers purge them "
        "(GRPO_DELETE_GRACE_SECONDS after the delete)."
    )
    limit_bytes: int | None = Field(
        description="GRPO_MAX_CHECKPOINT_BYTES_PER_PROJECT; null: no limit. A checkpoint that "
        "would take `used_bytes` beyond it is not kept and fails its job "
        "(`checkpoint_quota_exceeded`)."
    )


class UsageOut(BaseModel):
    object: Literal["usage"] = "usage"
    checkpoint_bytes: int = Field(
        description="Bytes of the project's kept checkpoints (jobs not deleted), as recorded "
        "when each was saved."
    )
    checkpoints: int = Field(description="How many kept checkpoints that is.")
    jobs_with_checkpoints: int
    jobs: list[JobUsage] = Field(description="Per job, the largest first, at most `limit`.")
    has_more: bool = Field(description="More jobs hold checkpoints than are listed.")
    checkpoint_quota: CheckpointQuotaOut = Field(
        description="The project's checkpoint storage against its limit."
    )


class GraderRunErrors(BaseModel):
    failure: Literal["error", "timeout"] | None = Field(
        default=None, description="Why the grade failed (it then scores 0), or null."
    )
    message: str | None = Field(default=None, description="The grader's own error, if any.")


class GraderRunMetadata(BaseModel):
    name: str
    type: str
    errors: GraderRunErrors
    execution_time: float = Field(description="Seconds the grade took.")
    scores: dict[str, float] = Field(description="The grader's score, and its sub-graders'.")


class GraderRunOut(BaseModel):
    reward: float = Field(description="The score in [0, 1] (0 when the grade failed).")
    metadata: GraderRunMetadata
    sub_rewards: dict[str, float] = Field(description="A multi grader's sub-grader scores.")


class GraderValidateOut(BaseModel):
    grader: dict[str, Any] = Field(description="The grader with every default filled in.")


class SessionIn(BaseModel):
    """POST /v1/session: the API key to sign in with (or send it as Authorization: Bearer)."""

    model_config = {"extra": "forbid"}
    key: str | None = Field(default=None, max_length=200, description="An API key.")


class SessionOut(BaseModel):
    project_id: str
    project_name: str
    key_id: str = Field(description="The key this session acts as.")
    via: Literal["cookie", "bearer"] = Field(description="How this request was authenticated.")
    expires_at: datetime | None = Field(
        default=None, description="When the session cookie stops working; null for Bearer."
    )
