"""Response bodies of what a job produces: metric series, samples, checkpoints."""

from __future__ import annotations

from datetime import datetime
from pathlib import PurePath
from typing import Literal

from pydantic import BaseModel, Field, field_validator


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
