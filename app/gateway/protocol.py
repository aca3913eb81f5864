"""What the gateway (app.gateway) and a `grpo inference` process (inference/) say to each other:
torch-free, so both sides import it.

A request for a fine-tuned model reaches a vLLM OpenAI server in two hops of different kinds:
1. the gateway asks a registered inference process to make the weights ready,
   ``POST {control_url}/engines/ensure`` with an :class:`EnsureRequest`, and gets back an
   :class:`EnsureResponse` (the vLLM server's base URL and the name to send as ``model``), or a
   503 whose body is a :class:`Busy` and whose ``Retry-After`` header says when to ask again
   (an engine is starting, or the memory budget is held by engines serving requests, or
   requests use every adapter slot of the engine), or a 429 with the same body when the
   request's project already holds its share of the engine's adapter slots and uses every one
   (:func:`busy_status`);
2. the gateway sends the client's request, its ``model`` replaced, to that vLLM server and passes
   the answer through (streamed chunk by chunk);
3. when the request ends, however it ends, the gateway releases the ensure's ``hold`` on LoRA
   adapters, ``POST {control_url}/engines/release`` with a :class:`HoldRelease`: an adapter is
   kept loaded for the requests using it, and only for them (inference.adapters).

Each process registers itself in ``inference_servers`` (app.gateway.servers_repository): its
control URL, the base models it serves, and its :class:`ServerState` as JSON, rewritten every
heartbeat. Nothing here is a host path: weights are named by job id and checkpoint folder name
(or, for a Tinker sampler save, by project, training client and save name), which the inference
process finds under its own checkpoint directory (jobspec.checkpoint_files).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from jobspec.checkpoint_files import PROJECT_ID, TINKER_MODEL_ID, TINKER_SAVE_NAME
from jobspec.prompt_format import TemplateTraits

ENSURE_PATH = "/engines/ensure"
RELEASE_PATH = "/engines/release"
ANY_BASE = "*"  # a server whose bases hold this serves any base model its host can load
HEARTBEAT_S = 5.0  # how often a process rewrites its row
# The header carrying the shared secret (GRPO_INFERENCE_TOKEN) on every control API call
# (`grpo inference` refuses to start without a token).
TOKEN_HEADER = "X-Inference-Token"
FRESH_S = 20.0  # a row older than this is a process that is gone: no request is routed to it


class WeightsRef(BaseModel):
    """A kept checkpoint: ``<checkpoint_dir>/<job_id>/<folder>`` on the inference host."""

    job_id: str = Field(max_length=64)
    folder: str = Field(max_length=64, pattern=r"^checkpoint-\d{6,}$")


class SamplerWeightsRef(BaseModel):
    """A Tinker training client's sampler weights save (LoRA adapters):
    ``<checkpoint_dir>/tinker/<project_id>/<model_id>/sampler_weights/<name>`` on the inference
    host (jobspec.checkpoint_files.tinker_save_folder). ``version`` (the save's time in
    microseconds) tells an overwritten save from the one an engine loaded before."""

    project_id: str = Field(max_length=64, pattern=rf"^{PROJECT_ID.pattern}$")
    model_id: str = Field(max_length=90, pattern=rf"^{TINKER_MODEL_ID.pattern}$")
    name: str = Field(max_length=128, pattern=rf"^{TINKER_SAVE_NAME.pattern}$")
    version: int = Field(ge=0)


class EnsureRequest(BaseModel):
    """Make these weights answer requests. ``base_model`` is the job spec's ``model`` (a
    packaged name, a Hub id in the host's cache, or a model folder the operator allows).
    ``full``: a full fine-tune's checkpoint, served by an engine of its own. ``adapter``: LoRA
    adapters, loaded into the engine of ``base_model`` (or of ``base_weights``, the full
    checkpoint a LoRA job started from). Neither: the base model itself."""

    base_model: str = Field(max_length=1200)
    full: WeightsRef | None = None
    base_weights: WeightsRef | None = None
    adapter: WeightsRef | SamplerWeightsRef | None = None


class EnsureResponse(BaseModel):
    base_url: str  # the vLLM OpenAI server, e.g. http://127.0.0.1:8301 (no /v1)
    served_model: str  # what to send as `model` to it
    warm: bool  # the weights were ready before this call (no engine start, no adapter load)
    # How the engine's chat template takes tools, probed with the trainer's own rule
    # (trainer.agents.chat) where the tokenizer is: a chat with tools is written as training
    # wrote it (app.gateway.chat_as_trained). None: not known (a process older than this
    # field, or a probe that failed); such a chat is refused rather than guessed.
    chat_traits: TemplateTraits | None = None
    # The engine's context in tokens (vLLM's max_model_len): a chat that sets no max_tokens is
    # sent at most this many (app.gateway.proxy). None: not known.
    max_model_len: int | None = Field(default=None, ge=1)
    # LoRA adapters: the ensure's hold on them, which keeps them loaded until the gateway
    # releases it (RELEASE_PATH) when its request ends. None: nothing to release.
    hold: str | None = Field(default=None, max_length=64)


class HoldRelease(BaseModel):
    """The body of ``POST /engines/release``: the request that ensured ``hold`` ended."""

    hold: str = Field(max_length=64)


BusyReason = Literal[
    "engine_starting",
    "memory_budget",
    "adapter_capacity",  # requests use every adapter slot of the engine (503)
    "adapter_share",  # the project holds its share of the slots, all in use (429)
    "adapter_loading",  # what a process older than adapter_capacity says for it
    "draining",
]


class Busy(BaseModel):
    """The body of a 503 (429 for ``adapter_share``: :func:`busy_status`): why the weights
    are not ready yet; ``Retry-After`` carries the wait."""

    reason: BusyReason
    detail: str
    retry_after_s: int


def busy_status(busy: Busy) -> int:
    """The HTTP status of a Busy answer: 429 when the request's own project is past its share
    (a fair-use limit: the project waits for its own requests), else 503 (the tier's)."""
    return 429 if busy.reason == "adapter_share" else 503


class EngineState(BaseModel):
    key: str  # the base model, or the checkpoint the engine loaded (a full fine-tune, init_from)
    base_url: str
    status: Literal["starting", "ready", "stopping"]
    adapters: list[str]  # served names of the warm LoRA adapters, least recently used first
    memory_bytes: int  # its share of the process's budget
    running_requests: int


class ServerState(BaseModel):
    engines: list[EngineState]
    memory_budget_bytes: int
    memory_used_bytes: int
    max_adapters_per_engine: int
    # Adapter slots of one engine a project may hold (GRPO_INFERENCE_MAX_ADAPTERS_PER_PROJECT);
    # None: a process older than the share.
    max_adapters_per_project: int | None = None
    # The largest LoRA rank its engines serve (GRPO_INFERENCE_MAX_LORA_RANK): /v1/jobs/validate
    # warns about a job whose checkpoints no process could serve. None: an older process.
    max_lora_rank: int | None = None
    # The dtype every engine of the process runs in when its operator set one
    # (GRPO_INFERENCE_DTYPE), which its engines' keys then carry; None: each its job's.
    dtype: str | None = None
