"""Worker settings: the shared persistence/queue settings plus what only a worker needs."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from app.core.queue import queue_for, tinker_queue
from app.core.settings import Settings
from jobspec.model_shape import Accelerator, detected_device_memory, host_memory
from jobspec.resources import MAX_DEVICES


def _default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(Settings):
    model_config = SettingsConfigDict(env_prefix="GRPO_", extra="ignore")

    worker_name: str = Field(default_factory=_default_name, description="Lease owner name.")
    device: str = Field(default="cpu", description="Torch device the trainer uses.")
    worker_devices: int | None = Field(
        default=None,
        ge=1,
        le=MAX_DEVICES,
        description=(
            "Devices this worker trains on, its size class: it consumes only the queue of "
            "jobs of exactly that many (app.core.queue.queue_for). Unset: the CUDA devices it "
            "sees when `device` is cuda (and CUDA is available), else 1; see `devices()`."
        ),
    )
    worker_serves: Literal["both", "jobs", "tinker"] = Field(
        default="both",
        description=(
            "What this worker takes: `jobs` (its size class's queue), `tinker` (the Tinker "
            "queue, GRPO_TINKER_QUEUE) or `both`, jobs first (a waiting job of its size class "
            "goes before a training client; the embedded default's worker)."
        ),
    )
    maintenance_seconds: float = Field(
        default=10.0, gt=0, description="How often the reaper and the re-dispatch sweep run."
    )
    sample_groups_per_step: int = Field(
        default=2, ge=0, le=64, description="Rollout groups per step kept for the samples API."
    )
    db_retry_seconds: float = Field(
        default=90.0,
        gt=0,
        description="How long progress writes retry while the database is unreachable.",
    )
    stop_grace_seconds: float = Field(
        default=60.0,
        gt=0,
        description=(
            "How long a trainer may take to stop after a cancel request or SIGTERM. Past it, "
            "the heartbeat process ends the job itself (cancelled, or handed back to the queue) "
            "and kills the worker process; keep the orchestrator's stop grace period longer."
        ),
    )

    webhook_poll_seconds: float = Field(
        default=2.0, gt=0, description="How often a worker looks for webhook deliveries due."
    )
    webhook_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=60,
        description="Connect and read timeout of one webhook delivery attempt.",
    )
    webhook_retry_base_seconds: float = Field(
        default=5.0,
        gt=0,
        description="Backoff of the first webhook retry; doubled for each later one (full jitter).",
    )
    webhook_retry_max_delay_seconds: float = Field(
        default=3600.0, gt=0, description="Longest wait between two tries of one delivery."
    )
    webhook_retry_window_hours: float = Field(
        default=24.0,
        gt=0,
        description="A delivery not accepted this long after it was queued is marked failed.",
    )
    webhook_retention_days: float = Field(
        default=30.0,
        gt=0,
        description="Delivered and failed webhook deliveries older than this are deleted.",
    )

    # ---- experiment trackers (a job's `integrations`): credentials come only from here
    mlflow_tracking_token: SecretStr | None = Field(
        default=None,
        description="Bearer token sent to every MLflow tracking server (GRPO_MLFLOW_TRACKING_URIS).",
    )
    mlflow_tracking_username: str | None = Field(
        default=None, description="HTTP basic-auth user for the MLflow tracking servers."
    )
    mlflow_tracking_password: SecretStr | None = Field(
        default=None, description="HTTP basic-auth password for the MLflow tracking servers."
    )
    wandb_api_key: SecretStr | None = Field(
        default=None,
        description="W&B API key (default: wandb's own WANDB_API_KEY or netrc login).",
    )
    wandb_base_url: str | None = Field(
        default=None, description="W&B server (default: wandb's own, WANDB_BASE_URL or the cloud)."
    )
    wandb_dir: Path | None = Field(
        default=None, description="Where W&B keeps run files; default: data_dir/wandb."
    )
    tracker_queue_size: int = Field(
        default=100_000,
        ge=1,
        le=10_000_000,
        description="Metric values a tracker export holds while its tracker is slow or down.",
    )
    tracker_batch_seconds: float = Field(
        default=2.0, gt=0, le=600, description="How often a tracker export sends its batch."
    )
    tracker_retry_seconds: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="How long one batch is retried (with backoff) before it is given up.",
    )
    tracker_flush_seconds: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="How long the end of a job waits for its tracker exports to finish.",
    )

    @property
    def resolved_wandb_dir(self) -> Path:
        return (self.wandb_dir or self.data_dir / "wandb").resolve()

    def devices(self) -> int:
        """`worker_devices`, or when unset the devices found for `device` (`detected_devices`,
        which may import torch: call it at start-up, not at import)."""
        return self.worker_devices or detected_devices(self.device)

    @property
    def consumed_queue(self) -> str:
        """The one queue this worker takes jobs from: its size class's."""
        return queue_for(self.queue_name, self.devices())

    @property
    def consumed_queues(self) -> list[str]:
        """The queues this worker consumes, jobs' first (GRPO_WORKER_SERVES)."""
        queues = []
        if self.worker_serves in ("both", "jobs"):
            queues.append(self.consumed_queue)
        if self.worker_serves in ("both", "tinker"):
            queues.append(tinker_queue(self))
        return queues

    @property
    def serves_jobs(self) -> bool:
        return self.worker_serves in ("both", "jobs")

    def device_announced(self) -> tuple[int, Accelerator]:
        """What this worker trains on (bytes, kind), as it announces it with its size class
        for the API's memory plan: its first GPU's bytes (nvidia-smi) and ``cuda`` when
        `device` is CUDA and a GPU is there, else the host's memory and ``cpu``."""
        memory, kind = detected_device_memory()
        if self.device.startswith("cuda") and kind == "cuda":
            return memory, "cuda"
        return host_memory(), "cpu"


def detected_devices(device: str) -> int:
    """The CUDA devices torch sees (after CUDA_VISIBLE_DEVICES) for the device `cuda`, and 1
    for anything else: a CPU, one named device (`cuda:1`), or CUDA that is not available."""
    if device != "cuda":
        return 1
    import torch  # only here: settings import no torch, and a CPU worker never loads it

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def build_worker_settings(**overrides: object) -> WorkerSettings:
    """Read the worker's settings from the environment (GRPO_*), explicit overrides winning.
    The device count is not detected here (`WorkerSettings.devices`): the worker resolves it
    once at start-up (worker.main)."""
    settings = WorkerSettings(**overrides)  # type: ignore[arg-type]
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return settings
