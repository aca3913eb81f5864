"""Sending a Tinker training model to a worker: the task ``worker.tinker_model`` with the model's
id, on the Tinker queue (app.core.queue.tinker_queue: apart from the jobs' queues). The API
knows the task only by name and never imports the worker; a failed send leaves the model
``starting``, and the workers' maintenance sends it again (worker.tinker_upkeep) until a worker
claims it or the claim timeout fails it (app.tinker.futures)."""

from __future__ import annotations

import logging
from functools import lru_cache

from celery import Celery

from app.core.queue import TINKER_MODEL_TASK, celery_config, tinker_queue
from app.core.settings import Settings

log = logging.getLogger(__name__)


@lru_cache(maxsize=8)
def _producer(broker: str, settings_json: str) -> Celery:
    from app.core.settings import Settings as _Settings

    celery = Celery("grpo-api-tinker")
    celery.conf.update(celery_config(_Settings.model_validate_json(settings_json)))
    return celery


def send_model(settings: Settings, model_id: str) -> bool:
    """Publish tinker_model(model_id); False (logged) when the broker is unreachable."""
    try:
        producer = _producer(settings.resolved_broker_url, settings.model_dump_json())
        producer.send_task(
            TINKER_MODEL_TASK,
            args=[model_id],
            queue=tinker_queue(settings),
            retry=True,
            retry_policy={"max_retries": 1, "interval_start": 0.2, "interval_step": 0.5},
        )
    except Exception as exc:  # any broker failure
        log.warning("could not send Tinker model %s to the broker: %s", model_id, exc)
        return False
    return True
