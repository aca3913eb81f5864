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
        "`pending_purge_bytes` plus the project's Tinker saves (docs/tinker.md)."
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


class TinkerCallsOut(BaseModel):
    kind: str = Field(
        description="create_model, load_weights, forward_backward, forward, optim_step, "
        "save_weights, save_weights_for_sampler or sample."
    )
    requests: int = Field(description="Calls of this kind made in the period.")
    applied: int = Field(description="Of those, applied by their model's worker.")
    failed: int = Field(
        description="Of those, failed (a bad call, a lost worker, an ended session)."
    )
    queued: int = Field(description="Of those, accepted and not applied yet.")


class TinkerUsageOut(BaseModel):
    days: int = Field(description="The period: the last `tinker_days` UTC days, today included.")
    since: str = Field(description="The period's first UTC day, YYYY-MM-DD.")
    sessions_created: int = Field(description="Tinker sessions created in the period.")
    models_created: int = Field(
        description="Training clients (models resident on a worker) created in the period, "
        "restores from a saved state included."
    )
    calls: list[TinkerCallsOut] = Field(
        description="The calls made in the period that return a future, per kind (by name), "
        "and what became of them. Tokens are not counted: a call's token counts are inside "
        "its stored body and result, not recorded per call. The calls of a session that "
        "ended more than GRPO_TINKER_RESULT_RETENTION_S ago are deleted, and not counted."
    )
    live_sessions: int = Field(
        description="Sessions open now (not closed, a heartbeat within "
        "GRPO_TINKER_SESSION_TTL_S), counted against `limit_sessions`."
    )
    limit_sessions: int = Field(description="GRPO_TINKER_MAX_SESSIONS_PER_PROJECT.")
    live_models: int = Field(
        description="Training clients starting, resident on a worker, or released while idle "
        "(written to disk, loaded again on their next call) now, counted against "
        "`limit_models`."
    )
    limit_models: int = Field(description="GRPO_TINKER_MAX_MODELS_PER_PROJECT.")
    stored_bytes: int = Field(
        description="Bytes of the project's Tinker calls and results stored now (a call's "
        "body until its worker applies it, a result until a minute after it is read), "
        "counted against `limit_stored_bytes`."
    )
    limit_stored_bytes: int = Field(description="GRPO_TINKER_MAX_STORED_BYTES_PER_PROJECT.")


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
    tinker: TinkerUsageOut = Field(
        description="The project's use of the Tinker API (/api/v1, docs/tinker.md) over the "
        "last `tinker_days` days, and its sessions and training clients now."
    )
