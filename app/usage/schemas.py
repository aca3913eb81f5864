"""Response bodies of /v1/usage."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


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


class JobQuotaOut(BaseModel):
    active_jobs: int = Field(
        description="The project's queued and running jobs (cancelling and pausing too; not "
        "paused ones), counted against `limit_jobs`."
    )
    limit_jobs: int = Field(
        description="GRPO_MAX_ACTIVE_JOBS_PER_PROJECT: a create or resume beyond it is a 429 "
        "`quota_exceeded`."
    )
    active_devices: int = Field(
        description="The devices those jobs ask for (their resources.devices, summed), "
        "counted against `limit_devices`."
    )
    limit_devices: int = Field(
        description="GRPO_MAX_ACTIVE_DEVICES_PER_PROJECT: a create or resume that would take "
        "`active_devices` beyond it is a 429 `quota_exceeded`."
    )


class InferenceModelUsage(BaseModel):
    model: str = Field(description="The model name as requests gave it.")
    day: str = Field(description="The UTC day, YYYY-MM-DD.")
    requests: int = Field(description="Chat and completion requests answered (or left early).")
    prompt_tokens: int
    completion_tokens: int = Field(
        description="For a stream the client left before its end, the chunks it received."
    )
    total_tokens: int


class InferenceUsageOut(BaseModel):
    day: str = Field(description="Today, UTC (YYYY-MM-DD): the day the quota counts.")
    tokens_today: int = Field(
        description="Prompt plus completion tokens of every model today, against "
        "`daily_token_limit`."
    )
    daily_token_limit: int | None = Field(
        description="GRPO_INFERENCE_DAILY_TOKENS_PER_PROJECT; null: no limit. A request once "
        "`tokens_today` has reached it is a 429 `insufficient_quota` until 00:00 UTC."
    )
    max_concurrent_requests: int = Field(
        description="GRPO_INFERENCE_MAX_CONCURRENT_PER_PROJECT: requests in flight at once "
        "(429 beyond)."
    )
    data: list[InferenceModelUsage] = Field(
        description="Per model and day over the last `inference_days` days, newest day "
        "first, then the most tokens."
    )
    has_more: bool = Field(description="More rows than are listed.")


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
    job_quota: JobQuotaOut = Field(
        description="The project's active jobs and their devices against its limits."
    )
    inference: InferenceUsageOut = Field(
        description="Tokens served by /v1/chat/completions and /v1/completions, and the "
        "project's inference limits."
    )
