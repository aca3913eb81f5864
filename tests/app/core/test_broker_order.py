"""A worker that serves jobs and Tinker training clients reads its queues in the order it names
them, jobs first, on both brokers: the embedded one (app.core.broker_order) and Redis (kombu's
``priority`` order). Real brokers, real messages: clients and jobs sent alternately are taken
every job first."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from celery import Celery
from kombu import Consumer, Queue
from kombu.message import Message

from app.core.queue import celery_config
from app.core.settings import build_settings
from tests.conftest import REDIS_URL


@pytest.mark.parametrize("broker", ["filesystem", "redis"])
def test_a_consumer_of_several_queues_takes_the_first_queues_messages_first(
    broker: str, tmp_path: Path
) -> None:
    settings = build_settings(
        data_dir=tmp_path,
        broker_url=REDIS_URL if broker == "redis" else None,
        queue_name=f"order-{secrets.token_hex(4)}",
    )
    celery = Celery("order-test")
    celery.conf.update(celery_config(settings))
    jobs, tinker = settings.queue_name, f"{settings.queue_name}-tinker"
    for n in range(3):  # alternately: a client, then a job
        celery.send_task("worker.tinker_model", args=[f"model-{n}"], queue=tinker)
        celery.send_task("worker.run_job", args=[f"job-{n}"], queue=jobs)
    taken: list[str] = []

    def take(body: object, message: Message) -> None:
        taken.append(str(message.headers["argsrepr"]))
        message.ack()

    with celery.connection_for_read() as connection:
        queues = [Queue(jobs, routing_key=jobs), Queue(tinker, routing_key=tinker)]
        with Consumer(connection, queues=queues, callbacks=[take], prefetch_count=1):
            while len(taken) < 6:
                connection.drain_events(timeout=10)
    # Every job before any client. (Within one queue the filesystem transport orders messages
    # by their millisecond stamp: sent in the same millisecond, they come in any order.)
    assert sorted(taken[:3]) == ["['job-0']", "['job-1']", "['job-2']"]
    assert sorted(taken[3:]) == ["['model-0']", "['model-1']", "['model-2']"]
