"""Response bodies of what a job produces: metric series, samples, checkpoints."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from jobspec.checkpoint_files import folder_name


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


class SampleToolCall(BaseModel):
    name: str
    arguments: str = Field(description="The call's arguments as JSON text, cut as said below.")
    arguments_cut: int = Field(description="Characters of the arguments left out (0: whole).")


class SampleTurn(BaseModel):
    source: Literal["model", "tool", "environment"] = Field(
        description="`model`: an assistant turn; `tool`: a tool call's result; `environment`: "
        "a message of the environment (its reset or a step)."
    )
    role: str = Field(description="The chat role the turn had in the conversation.")
    content: str = Field(
        description="A model turn's text without its tool calls (as written when a call in it "
        "could not be read), a tool's result, or the environment's message."
    )
    content_cut: int = Field(description="Characters of the content left out (0: whole).")
    name: str | None = Field(default=None, description="The tool a result is from.")
    tool_calls: list[SampleToolCall] = Field(
        default_factory=list, description="A model turn's well-formed tool calls."
    )
    malformed: list[str] = Field(
        default_factory=list, description="Why calls of a model turn could not be read."
    )
    error: str | None = Field(default=None, description="Why a tool call failed.")


class SampleTranscript(BaseModel):
    end_reason: str | None = Field(
        description="What ended the episode (done, max_turns, max_tool_calls, "
        "max_episode_tokens, truncated, malformed_call, error, template_drift)."
    )
    turns: list[SampleTurn] = Field(
        description="The turns after the row's own conversation (the group's prompt), in "
        "order. Bounded by the trainer: at most 16 turns, a content or a call's arguments cut "
        "at 1,000 characters, names, errors and reasons at 200, and 4,000 characters for the "
        "whole transcript, after which the rest of the turns are left out."
    )
    turns_left_out: int = Field(description="Turns of the episode not in `turns`.")
    end_detail: str | None = Field(
        default=None,
        description="Why the episode ended where the reason alone does not say: the "
        "environment's error (error), the first unreadable call (malformed_call), where the "
        "template re-rendered (template_drift); at most 200 characters.",
    )


class SampleCompletion(BaseModel):
    text: str = Field(description="The completion; for an agent episode, its final answer.")
    reward: float
    rewards: dict[str, float]
    advantage: float
    num_tokens: int
    finish_reason: str
    transcript: SampleTranscript | None = Field(
        default=None,
        description="An agent episode's turns (tool calls, tool results, environment "
        "messages) and its end reason; null for a single completion.",
    )


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
        return folder_name(path)


class CheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CheckpointOut]
