"""Sending jobs to workers. The API knows the task only by name ("worker.run_job") and never
imports the worker; it sends after the job row is committed, and a failed send leaves the job
queued for the re-dispatch sweep instead of failing the request."""

from __future__ import annotations

import logging
from typing import Any, Protocol

from celery import Celery

from app.core.settings import Settings

log = logging.getLogger(__name__)

RUN_JOB_TASK = "worker.run_job"
# A Tinker training client held resident by a worker (worker/tinker_model.py; app/tinker).
TINKER_MODEL_TASK = "worker.tinker_model"


def queue_for(base: str, devices: int) -> str:
    """The queue of a size class: the jobs that train on `devices` devices, and the workers
    that have that many. One device is the base queue itself (`GRPO_QUEUE_NAME`); N > 1 is
    `<base>-<N>dev`. The API sends a job to the queue of its `resources.devices`, a worker
    consumes the queue of its `GRPO_WORKER_DEVICES` and nothing else, and every re-send goes
    back to the queue recorded on the job (`jobs.queue`), so this rule is declared here once."""
    if devices < 1:
        raise ValueError(f"a size class has at least one device, not {devices}")
    return base if devices == 1 else f"{base}-{devices}dev"


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings shared by producer (API) and consumer (worker)."""
    broker = settings.resolved_broker_url
    transport: dict[str, Any] = {}
    if broker.startswith("filesystem://"):
        folder = settings.broker_folder
        for sub in ("queue", "processed", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        transport = {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            # kombu keeps exchange bindings in ./control unless told otherwise.
            "control_folder": str(folder / "control"),
            "store_processed": False,
        }
    elif broker.startswith(("redis://", "rediss://")):
        # Longer than any lease gap: a message is redelivered only after the reaper would
        # have re-queued the job anyway, and the lease makes a redelivery harmless.
        transport = {
            "visibility_timeout": max(3600, int(settings.lease_seconds * 4)),
            "socket_connect_timeout": 2,
            "socket_timeout": 5,
        }
    return {
        "broker_url": broker,
        "broker_transport_options": transport,
        "broker_connection_timeout": 2,
        "broker_connection_retry_on_startup": True,
        "task_default_queue": settings.queue_name,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_ignore_result": True,
        "worker_prefetch_multiplier": 1,
        # A Redis blip must not kill a healthy training task: the database lease, not the broker
        # connection, decides who owns a job, so a redelivered copy simply finds the lease held.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_backend": None,
        "worker_hijack_root_logger": False,
    }


class Dispatcher(Protocol):
    def send(self, job_id: str, queue: str | None = None) -> bool: ...


class CeleryDispatcher:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._celery = Celery("grpo-api")
        self._celery.conf.update(celery_config(settings))

    def send(self, job_id: str, queue: str | None = None) -> bool:
        """Publish run_job(job_id) to `queue` (default: this process's queue); False (logged)
        when the broker is unreachable."""
        try:
            self._celery.send_task(
                RUN_JOB_TASK,
                args=[job_id],
                queue=queue or self._settings.queue_name,
                retry=True,
                retry_policy={"max_retries": 1, "interval_start": 0.2, "interval_step": 0.5},
            )
        except Exception as exc:  # any broker failure: the sweep re-sends later
            log.warning("could not send job %s to the broker: %s", job_id, exc)
            return False
        return True
