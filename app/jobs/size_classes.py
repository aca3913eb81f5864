"""Whether anyone will run a job of this size: a job of N devices runs only on a worker of
exactly N devices (app.core.queue.queue_for), so a job whose size class no worker serves would
wait `queued` without a word. Workers announce their class every maintenance pass
(worker.maintenance.announce_worker); a create whose class none of the deployment's recently
seen workers has gets a warning, in its answer and as a `no_worker` event on the job.

Nothing is said while no worker at all was seen lately (a fresh start, a deployment whose
workers start after the API, an outage of every worker): then nothing is known of the size
classes. The waiting job holds a dispatch slot of its own size class only (app.jobs.dispatch),
so it never holds up its project's other jobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy.orm import Session

from app.core.clock import utcnow
from app.core.models import JobEvent
from app.core.settings import Settings
from app.jobs import events_repository as events_repo
from app.jobs import workers_repository as workers_repo

# How long one API process trusts what it read of the workers table: a create costs no query
# for it while the answer is this fresh (job creation is the API's hot path).
REFRESH_S = 10.0

NO_WORKER_EVENT = "no_worker"


class SizeClassWatch:
    """The size classes of the deployment's workers (those of the settings' `queue_name`) seen
    in the last `worker_seen_seconds`, read at most once per REFRESH_S by this process."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        # (when read, by the clock; of which queue name; the classes). Replaced whole, so
        # threads never see half of one.
        self._read: tuple[float, str, frozenset[int]] | None = None

    def classes_seen(self, session: Session) -> frozenset[int]:
        queue_name = self.settings.queue_name
        read = self._read
        if read is not None and read[1] == queue_name and self._clock() - read[0] < REFRESH_S:
            return read[2]
        since = utcnow() - timedelta(seconds=self.settings.worker_seen_seconds)
        seen = workers_repo.device_classes_seen(session, queue_name=queue_name, since=since)
        self._read = (self._clock(), queue_name, seen)
        return seen

    def warning(self, session: Session, *, devices: int) -> str | None:
        """Why a job of `devices` devices may wait for good, or None."""
        seen = self.classes_seen(session)
        if not seen or devices in seen:
            return None
        classes = ", ".join(str(n) for n in sorted(seen))
        return (
            f"no worker of {devices} device(s) has been seen in the last "
            f"{self.settings.worker_seen_seconds:g} s (the workers seen have {classes} device(s)): this job "
            f"waits queued until a worker with GRPO_WORKER_DEVICES={devices} runs; cancel it, "
            "or submit it with a resources.devices that a worker has"
        )


def record_warning(session: Session, *, job_id: str, devices: int, message: str) -> None:
    """The warning as the new job's event (in the create's unit of work)."""
    events_repo.insert_new(
        session,
        event=JobEvent(
            job_id=job_id,
            attempt=0,
            type=NO_WORKER_EVENT,
            level="warning",
            message=message,
            data={"devices": devices},
            created_at=utcnow(),
        ),
    )
