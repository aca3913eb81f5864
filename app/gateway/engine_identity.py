"""Which engine serves a request, beyond which weights: the base model's Hub revision and the
dtype the job's rollouts ran in, so that the served model answers as the trained model does.
Torch-free; the gateway (app.gateway.routing) and `grpo inference` (inference.pool) both read it.

:class:`EngineOptions` holds the two; the ensure body a process reads is
:class:`EngineEnsureRequest`, app.gateway.protocol's :class:`EnsureRequest` with them (a
process that only knows EnsureRequest ignores them, so old and new processes and gateways keep
talking). :func:`engine_key` names a base model's engine (or
a checkpoint's) for the pool and for the gateway's warmth ranking: two jobs that trained over
different revisions, or rolled out in different dtypes, never share an engine.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from app.gateway.protocol import EnsureRequest
from jobspec import CPU_ROLLOUT_DTYPE
from jobspec.checkpoint_files import PROJECT_ID
from jobspec.model_source import MAX_REVISION_CHARS

EngineDtype = Literal["float32", "bfloat16"]
# A bare base model (no job), or a job that left rollout.dtype unset, answers in the CPU
# rollouts' dtype (float32): the API cannot know the device a job's worker had (a GPU worker
# resolves unset to bfloat16; jobspec.rollout_dtype). Pin rollout.dtype to serve otherwise.
DEFAULT_DTYPE: EngineDtype = CPU_ROLLOUT_DTYPE
REVISION_MARK = "@"
DTYPE_MARK = "#"


class EngineOptions(BaseModel):
    """How an engine must run the weights to answer as the job's rollouts did."""

    revision: str | None = Field(
        default=None,
        max_length=MAX_REVISION_CHARS,
        description="The base model's Hub revision (the job's model_revision); None: main. "
        "Only a base model's engine reads it; a checkpoint's weights are its own.",
    )
    dtype: EngineDtype = Field(
        default=DEFAULT_DTYPE,
        description="The dtype the job's rollouts ran in (its rollout.dtype); the inference "
        "process serves in it unless its operator set GRPO_INFERENCE_DTYPE.",
    )


class EngineEnsureRequest(EnsureRequest, EngineOptions):
    """The ensure body (app.gateway.protocol.ENSURE_PATH): the weights, how to run them, and
    the project asking (whose share of an engine's adapter slots LoRA adapters count against:
    inference.adapters)."""

    project_id: str | None = Field(
        default=None,
        max_length=64,
        pattern=rf"^{PROJECT_ID.pattern}$",
        description="The project of the request (the gateway's; a project serves only its "
        "own fine-tuned weights). None: an older gateway, or a caller with no project.",
    )

    def options(self) -> EngineOptions:
        return EngineOptions(revision=self.revision, dtype=self.dtype)


def engine_dtype(job_dtype: str, operator_dtype: str | None) -> str:
    """The dtype an engine runs in: the inference process operator's (GRPO_INFERENCE_DTYPE,
    told to the gateway in ServerState.dtype) when set, else the job's rollout dtype."""
    return operator_dtype or job_dtype


def engine_key(name: str, *, revision: str | None = None, dtype: str = DEFAULT_DTYPE) -> str:
    """The key (and served name) of the engine of ``name`` (a base model, or a checkpoint's
    served name) at ``revision`` in ``dtype``: ``name`` itself for the default revision and
    dtype, else marked with each, e.g. ``owner/model@v2#bfloat16``."""
    key = name
    if revision:
        key += f"{REVISION_MARK}{revision}"
    if dtype != DEFAULT_DTYPE:
        key += f"{DTYPE_MARK}{dtype}"
    return key
