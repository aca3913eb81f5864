"""The settings of the workers' size classes (issue 32) that the API reads: the device a job's
memory plan must fit (``GRPO_WORKER_DEVICE_MEMORY_GIB``, ``GRPO_WORKER_DEVICE_KIND``) and how
long a worker's announced size class counts. A part of :class:`app.core.settings.Settings`
(which inherits these fields), kept apart to keep that module readable."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from jobspec.model_shape import Accelerator, workers_device


class SizeClassSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GRPO_", extra="ignore")

    worker_device_memory_gib: float | None = Field(
        default=None,
        gt=0,
        le=1 << 20,
        description="Memory of one worker device (GiB) that a job's memory plan must fit "
        "(POST /v1/jobs/validate; 422 at create beyond). Unset: this host's first CUDA "
        "device's (nvidia-smi), else its memory.",
    )
    worker_device_kind: Accelerator | None = Field(
        default=None,
        description="What the workers' devices are, `cuda` or `cpu`, for the memory plan: a "
        "CUDA worker rolls out in bfloat16 and its engine sleeps through the update, a CPU "
        "plan counts float32 rollouts and twice the KV cache. Unset: this host's (a CUDA "
        "device seen by nvidia-smi, else cpu); set it, with GRPO_WORKER_DEVICE_MEMORY_GIB, on "
        "an API host without the workers' GPUs.",
    )
    worker_seen_seconds: float = Field(
        default=300.0,
        gt=0,
        le=86_400,
        description=(
            "A worker announces its size class every maintenance pass; one not seen for this "
            "long no longer counts. A job whose size class no counted worker has is told so at "
            "creation (a warning and a `no_worker` event), while some worker is counted."
        ),
    )

    def worker_device_memory(self) -> tuple[int, Accelerator]:
        """Bytes of one worker device and its kind: as declared, else detected on this host
        (``jobspec.model_shape.workers_device``)."""
        return workers_device(self.worker_device_memory_gib, self.worker_device_kind)
