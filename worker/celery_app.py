"""The Celery app of the worker, built from settings by `create_celery`."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.signals import worker_shutting_down

from app.core.queue import RUN_JOB_TASK, TINKER_MODEL_TASK, celery_config
from worker.context import WorkerContext
from worker.runner import run_job
from worker.tinker_model import hold_tinker_model

log = logging.getLogger(__name__)


def create_celery(ctx: WorkerContext) -> Celery:
    celery = Celery("grpo-worker")
    celery.conf.update(celery_config(ctx.settings))

    @celery.task(name=RUN_JOB_TASK, acks_late=True, reject_on_worker_lost=True)
    def run_job_task(job_id: str) -> str:
        # Thin: ids in, plain function out. All rules live in worker.runner.
        outcome = run_job(ctx, job_id)
        log.info("job %s: %s", job_id, outcome)
        return outcome

    @celery.task(name=TINKER_MODEL_TASK, acks_late=True, reject_on_worker_lost=True)
    def tinker_model_task(model_id: str) -> str:
        # Thin, as run_job_task: the model is held until its session ends (worker.tinker_model).
        outcome = hold_tinker_model(ctx, model_id)
        log.info("tinker model %s: %s", model_id, outcome)
        return outcome

    def _on_shutdown(**_: Any) -> None:
        # Warm shutdown (SIGTERM): the running job checkpoints at its next step boundary and is
        # handed back to the queue; Celery waits for the task to return before exiting.
        # This handler runs only between bytecodes of the main thread, so a trainer stuck in a
        # C call delays it; the job's heartbeat process hears the signal anyway (through the
        # signal wakeup fd) and, past `stop_grace_seconds`, hands the job back and kills this
        # process (worker.heartbeat).
        ctx.shutdown.set()

    worker_shutting_down.connect(_on_shutdown, weak=False)
    return celery
