"""Start a worker process: maintenance and webhook threads + a Celery worker consuming one job at
a time."""

from __future__ import annotations

import logging

from worker.celery_app import create_celery
from worker.context import build_context
from worker.maintenance import MaintenanceThread
from worker.settings import WorkerSettings, build_worker_settings
from worker.webhooks import WebhookThread

log = logging.getLogger(__name__)


def run_worker(settings: WorkerSettings | None = None, loglevel: str = "INFO") -> None:
    settings = settings or build_worker_settings()
    logging.basicConfig(level=loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The size class, found once (it may ask torch for the CUDA devices) and kept in the
    # settings every part of this worker reads.
    settings = settings.model_copy(update={"worker_devices": settings.devices()})
    queues, devices = settings.consumed_queues, settings.devices()
    log.info(
        "worker %s: %d device(s) (%s), consuming %s, in that order (jobs of %d device(s) "
        "only; GRPO_WORKER_SERVES=%s)",
        *(settings.worker_name, devices, settings.device),
        " then ".join(f"queue {queue!r}" for queue in queues),
        *(devices, settings.worker_serves),
    )
    ctx = build_context(settings)
    celery = create_celery(ctx)
    maintenance = MaintenanceThread(ctx)
    maintenance.start()
    webhooks = WebhookThread(ctx)
    webhooks.start()
    try:
        # solo pool: the job runs in this process (one job per worker process, no fork of
        # torch/vLLM state), and SIGTERM reaches our shutdown hook while the task runs.
        celery.worker_main(
            [
                "worker",
                "--pool=solo",
                "--concurrency=1",
                f"--queues={','.join(queues)}",
                f"--hostname={settings.worker_name}@%h",
                "--without-gossip",
                "--without-mingle",
                # Celery's own event heartbeats feed monitors we do not run (the lease heartbeat
                # in the database is what counts). During a broker outage their publisher
                # retries inside the consumer loop and blocks it until the broker is back, so
                # the worker did not notice the outage (nor restore its unacked message) while
                # it lasted; test_redis_restart_during_a_run caught that as a flaky hang.
                "--without-heartbeat",
                f"--loglevel={loglevel}",
            ]
        )
    finally:
        maintenance.stop()
        webhooks.stop()
