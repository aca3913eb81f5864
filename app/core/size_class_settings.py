"""The settings of the workers' size classes (docs/scaling.md) that the API reads: the device a
job's memory plan must fit (``GRPO_WORKER_DEVICE_MEMORY_GIB``, ``GRPO_WORKER_DEVICE_KIND``) and how
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
        "(POST /v1/jobs/validate; 422 at create beyond). Unset: what the job's workers "
        "announce (their first CUDA device's, else their memory); before any is seen, this "
        "host's.",
    )
    worker_device_kind: Accelerator | None = Field(
        default=None,
        description="What the workers' devices are, `cuda` or `cpu`, for the memory plan: a "
        "CUDA worker rolls out in bfloat16 and its engine sleeps through the update, a CPU "
        "plan counts float32 rollouts and twice the KV cache. Unset: the "
        "workers' own, as they announce it with their size class; before any worker of the "
        "job's size was seen, this host's (a CUDA device seen by nvidia-smi, else cpu). Set "
        "it, with GRPO_WORKER_DEVICE_MEMORY_GIB, where the plan must not wait for a worker.",
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

    def declares_worker_device(self) -> bool:
        """Both the workers' device memory and kind are declared (nothing to look up)."""
        return self.worker_device_memory_gib is not None and self.worker_device_kind is not None

    def worker_device_memory(
        self, announced: tuple[int, Accelerator] | None = None
    ) -> tuple[int, Accelerator]:
        """Bytes of one worker device and its kind: as declared, else as the job's workers
        ``announced``, else detected on this host (``jobspec.model_shape.workers_device``)."""
        return workers_device(self.worker_device_memory_gib, self.worker_device_kind, announced)
