"""The embedded broker (kombu's filesystem transport) consuming queues in the order a worker
names them: a worker that serves jobs and Tinker training clients (GRPO_WORKER_SERVES=both)
takes a waiting job before a waiting client.

kombu's virtual transports read a consumer's queues round robin (``FairCycle``): with a job
and a client both waiting, either could come first. Its Redis transport has the
``priority`` order built in (app.core.queue.celery_config sets it); this transport gives the
filesystem one the same: each read tries the queues from the first.
"""

from __future__ import annotations

from collections.abc import Callable
from queue import Empty
from typing import Any

from kombu.transport import filesystem
from kombu.utils.scheduling import FairCycle

# What Celery's broker_transport names for the embedded broker.
ORDERED_FILESYSTEM = "app.core.broker_order:OrderedFilesystemTransport"


class OrderedCycle(FairCycle):  # type: ignore[misc]
    """Reads from the first queue that has a message, in the consumer's order."""

    def get(self, callback: Callable[..., Any], **kwargs: Any) -> Any:
        for resource in list(self.resources):
            try:
                return self.fun(resource, callback, **kwargs)
            except self.predicate:
                continue
        raise self.predicate()


class OrderedChannel(filesystem.Channel):  # type: ignore[misc]
    def _reset_cycle(self) -> None:
        self._cycle = OrderedCycle(self._get_and_deliver, self._active_queues, Empty)


class OrderedFilesystemTransport(filesystem.Transport):  # type: ignore[misc]
    Channel = OrderedChannel
