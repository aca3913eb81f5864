"""The model objects of /v1/models, in OpenAI's shapes (openai-python's `Model`), so the SDK's
`models.list()` and `models.retrieve()` read them unchanged. Like vLLM's model cards, a model
carries its `parent`; our own fields sit under `grpo_service`, which the SDK keeps as extras."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from app.gateway.served_kinds import ModelKind

# The longest model name accepted (path parameter, later the `model` of a chat request): above
# the longest name a job's weights can have, `ft:` + a model of 1,000 characters + a suffix of
# 64 + a job id + `:ckpt-step-<step>` (about 1,160 characters), and a Tinker sampler save's
# (a base model of at most 300 + a name of 128 + a model id of at most 86).
MAX_MODEL_NAME = 1200


def holds_control_characters(name: str) -> bool:
    """No model name the gateway serves holds one (a newline, a tab, NUL, DEL)."""
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in name)


class ModelInfo(BaseModel):
    kind: ModelKind = Field(
        description="base: a base model as packaged; full: a full fine-tune's weights; lora: "
        "LoRA adapters over `parent`."
    )
    job_id: str | None = Field(
        default=None, description="The job that trained it (null for a Tinker save)."
    )
    step: int | None = Field(
        default=None,
        description="The step of the checkpoint it names (the job's last kept "
        "checkpoint for its `ft:` name).",
    )
    tinker_path: str | None = Field(
        default=None,
        description="A Tinker sampler weights save's `tinker://` path (its other name).",
    )


class ModelOut(BaseModel):
    id: str = Field(description="The name to give as `model`.")
    object: Literal["model"] = "model"
    created: int = Field(
        description="Unix seconds: when the job finished (its `ft:` name), when the "
        "checkpoint was saved, or for a base model when the project was created."
    )
    owned_by: str = Field(description='"system" for base models, else the project id.')
    parent: str | None = Field(
        default=None,
        description="The base model it was trained from, as the job named it (null for a base "
        "model). A checkpoint's parent is the base model too, not its job's `ft:` name.",
    )
    grpo_service: ModelInfo


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelOut]
    has_more: bool = Field(description="More of the project's jobs hold models.")
    next_after: str | None = Field(description="Pass as `after` to get the next page.")
