"""Sending jobs to workers. The API knows the task only by name ("worker.run_job") and never
imports the worker; it sends after the job row is committed, and a failed send leaves the job
queued for the re-dispatch sweep instead of failing the request."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from celery import Celery
from kombu.transport import filesystem, redis

from app.core.broker_order import ORDERED_FILESYSTEM
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


def tinker_queue(settings: Settings) -> str:
    """The queue Tinker training clients are sent on: GRPO_TINKER_QUEUE, or
    `<GRPO_QUEUE_NAME>-tinker`. Apart from the jobs' queues, so that an operator can give Tinker
    workers of its own (GRPO_WORKER_SERVES) and a held client never stands in a job's way."""
    return settings.tinker_queue or f"{settings.queue_name}-tinker"


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
            # A worker consuming several queues (jobs, then Tinker clients) takes from the
            # first non-empty one in its order, not round robin: jobs first.
            "queue_order_strategy": "priority",
            "visibility_timeout": max(3600, int(settings.lease_seconds * 4)),
            "socket_connect_timeout": 2,
            "socket_timeout": 5,
        }
    ordered = {"broker_transport": ORDERED_FILESYSTEM} if broker.startswith("filesystem://") else {}
    return {
        "broker_url": broker,
        **ordered,
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


# ---- withdrawing a job's messages: a cancelled job's message would wait in the
# broker until a worker took it only to drop it, and with a size class no worker runs, forever.

# Most messages of one queue a withdrawal reads, so that its cost stays bounded however long the
# queue grew; and how many it reads per round trip.
WITHDRAW_SCAN = 10_000
WITHDRAW_CHUNK = 500


def withdraw(dispatcher: Dispatcher, *, job_id: str, queue: str) -> int:
    """Remove the run_job messages of `job_id` still waiting in `queue`; how many went. For the
    Redis broker (a list per queue and priority) and the embedded filesystem broker (a file per
    message); any other transport keeps them (a worker drops a message of a job that is not
    queued). Best effort: one connection attempt, at most WITHDRAW_SCAN messages read, and a
    failure logged, never raised (the caller's work is committed already)."""
    if not isinstance(dispatcher, CeleryDispatcher):
        return 0  # publishes to no broker (a test's stand-in)
    try:
        with dispatcher._celery.connection_for_write() as connection:
            channel = connection.channel()  # one attempt, no retry loop
            try:
                return _withdraw_from(channel, job_id=job_id, queue=queue)
            finally:
                channel.close()
    except Exception as exc:
        log.warning("could not remove job %s's messages from queue %s: %s", job_id, queue, exc)
        return 0


def _withdraw_from(channel: Any, *, job_id: str, queue: str) -> int:
    """Kombu's own layout of each transport: the Redis channel's keys of `queue` (one per
    priority step, with its global prefix) and the filesystem channel's message files."""
    if isinstance(channel, redis.Channel):
        return _withdraw_from_redis(channel, job_id=job_id, queue=queue)
    if isinstance(channel, filesystem.Channel):
        return _withdraw_from_folder(Path(channel.data_folder_in), job_id=job_id, queue=queue)
    return 0


def _withdraw_from_redis(channel: Any, *, job_id: str, queue: str) -> int:
    keys = dict.fromkeys(channel._q_for_pri(queue, pri) for pri in channel.priority_steps)
    removed = 0
    with channel.conn_or_acquire() as client:
        for key in keys:
            found: set[bytes] = set()
            for start in range(0, min(client.llen(key), WITHDRAW_SCAN), WITHDRAW_CHUNK):
                chunk = client.lrange(key, start, start + WITHDRAW_CHUNK - 1)
                found.update(raw for raw in chunk if _runs_job(raw, job_id))
            # Removed by value: messages a worker popped meanwhile are simply not found.
            removed += sum(int(client.lrem(key, 0, raw)) for raw in found)
    return removed


def _withdraw_from_folder(folder: Path, *, job_id: str, queue: str) -> int:
    # kombu names a message `<time>_<uuid>.<queue>.msg`, and takes the oldest name first.
    names = sorted(n for n in os.listdir(folder) if n.partition(".")[2] == f"{queue}.msg")
    removed = 0
    for name in names[:WITHDRAW_SCAN]:
        path = folder / name
        with contextlib.suppress(FileNotFoundError):  # a worker took it meanwhile
            if _runs_job(path.read_bytes(), job_id):
                path.unlink()
                removed += 1
    return removed


def _runs_job(raw: bytes, job_id: str) -> bool:
    """Whether the raw broker message (kombu's JSON envelope, its body base64: Celery's
    protocol 2, `[args, kwargs, embed]`) is run_job(job_id)."""
    if job_id.encode() not in raw:
        return False  # the id is in the envelope's headers (argsrepr): most messages end here
    try:
        message = json.loads(raw)
        if message["headers"]["task"] != RUN_JOB_TASK:
            return False
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
    except (ValueError, KeyError, TypeError, IndexError):
        return False  # not a message of ours, or one still being written
    return bool(args) and args[0] == job_id
