"""Whether anyone will run a job of this size: a job of N devices runs only on a worker of
exactly N devices (app.core.queue.queue_for), so a job whose size class no worker serves would
wait `queued` without a word. Workers announce their class every maintenance pass
(worker.maintenance.announce_worker); a create whose class none of the deployment's recently
seen workers has gets a warning, in its answer and as a `no_worker` event on the job, and the
re-dispatch sweep sends no message to such a class's queue, where nobody would take it
(worker.maintenance.redispatch_queued).

A worker holding Tinker training clients (GRPO_WORKER_SERVES=both) takes no job until they are
released (after GRPO_TINKER_IDLE_RELEASE_S without a call), so a class whose every worker holds
some (each worker announces how many it holds) makes its jobs wait too: the dry run warns, and
the maintenance sweep writes one `tinker_held` event per waiting job and attempt
(`note_jobs_waiting_for_tinker`; a job re-queued later is told again).

Nothing is said (and every lost message is sent again) while no worker of the deployment was
seen lately (a fresh start, a deployment whose workers start after the API, an outage of every
worker): then nothing is known of its size classes. A worker that takes no jobs
(GRPO_WORKER_SERVES=tinker) has no size class. The waiting job holds a dispatch slot of its own
size class only (app.jobs.dispatch), so it never holds up its project's other jobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.orm import Session, sessionmaker

from app.core.clock import utcnow
from app.core.db import session_scope
from app.core.models import JobEvent
from app.core.queue import queue_for
from app.core.settings import Settings
from app.jobs import events_repository as events_repo
from app.jobs import repository as jobs_repo
from app.jobs import workers_repository as workers_repo
from app.jobs.workers_repository import SizeClassSeen
from jobspec.model_shape import Accelerator
from jobspec.resources import MAX_DEVICES

# How long one API process trusts what it read of the workers table: a create costs no query
# for it while the answer is this fresh (job creation is the API's hot path).
REFRESH_S = 10.0

NO_WORKER_EVENT = "no_worker"


@dataclass(frozen=True)
class WorkersSeen:
    """The size classes of the workers seen in the last `worker_seen_seconds`."""

    classes: tuple[SizeClassSeen, ...]

    def devices(self) -> frozenset[int]:
        return frozenset(c.devices for c in self.classes)

    def of_queue(self, queue: str) -> SizeClassSeen | None:
        """The class whose workers consume `queue`, if any was seen."""
        return next((c for c in self.classes if queue_for(c.queue_name, c.devices) == queue), None)

    def queues_nobody_takes(self) -> frozenset[str]:
        """The queues of every size class of the deployments seen that none of their workers
        has: a message sent there waits for a worker that may never come."""
        served = {queue_for(c.queue_name, c.devices) for c in self.classes}
        deployments = {c.queue_name for c in self.classes}
        every = {queue_for(d, n) for d in deployments for n in range(1, MAX_DEVICES + 1)}
        return frozenset(every - served)

    def device_of(self, queue: str) -> tuple[int, Accelerator] | None:
        """The device the workers consuming `queue` announced (bytes, kind), else the one the
        deployment's other workers announced (a job of a size nobody runs yet is planned for
        the devices the deployment has: the smallest GPU when any has one), else None."""
        own = self.of_queue(queue)
        classes = [own] if own is not None and own.device_memory else self.classes
        for kind in ("cuda", "cpu"):
            sizes = [c.device_memory for c in classes if c.device_kind == kind and c.device_memory]
            if sizes:
                return min(sizes), kind
        return None

    def held_by_tinker(self) -> list[SizeClassSeen]:
        """The classes whose every worker holds Tinker training clients."""
        return [c for c in self.classes if all_hold_tinker(c)]


def all_hold_tinker(size_class: SizeClassSeen) -> bool:
    """Every worker of the class held Tinker training clients when last seen: none takes a
    job until one of them is released."""
    return size_class.holding_tinker >= size_class.workers > 0


def workers_seen(
    session: Session, settings: Settings, *, queue_name: str | None = None
) -> WorkersSeen:
    """What the workers of the deployment `queue_name` (or of all) announced lately."""
    since = utcnow() - timedelta(seconds=settings.worker_seen_seconds)
    found = workers_repo.size_classes_seen(session, since=since, queue_name=queue_name)
    return WorkersSeen(tuple(found))


def tinker_wait_message(held: SizeClassSeen, settings: Settings) -> str:
    """Why a job of `held`'s size waits while its workers hold Tinker training clients, and
    what frees them."""
    return (
        f"all {held.workers} worker(s) of {held.devices} device(s) seen in the last "
        f"{settings.worker_seen_seconds:g} s hold Tinker training clients: a job of this size "
        "waits until one is free. A training client with no call for "
        f"GRPO_TINKER_IDLE_RELEASE_S ({settings.tinker_idle_release_s:g} s) is released, "
        "freeing its worker; an operator can give Tinker workers of their own "
        "(GRPO_WORKER_SERVES=tinker on some workers, jobs on the others)"
    )


class SizeClassWatch:
    """The size classes of the deployment's workers (those of the settings' `queue_name`) seen
    in the last `worker_seen_seconds`, read at most once per REFRESH_S by this process."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        # (when read, by the clock; of which queue name; what was seen). Replaced whole, so
        # threads never see half of one.
        self._read: tuple[float, str, WorkersSeen] | None = None

    def seen(self, session: Session) -> WorkersSeen:
        queue_name = self.settings.queue_name
        read = self._read
        if read is not None and read[1] == queue_name and self._clock() - read[0] < REFRESH_S:
            return read[2]
        seen = workers_seen(session, self.settings, queue_name=queue_name)
        self._read = (self._clock(), queue_name, seen)
        return seen

    def classes_seen(self, session: Session) -> frozenset[int]:
        return self.seen(session).devices()

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

    def tinker_warning(self, session: Session, *, devices: int) -> str | None:
        """Why a job of `devices` devices would wait for Tinker training clients, or None."""
        size_class = self.seen(session).of_queue(queue_for(self.settings.queue_name, devices))
        if size_class is None or not all_hold_tinker(size_class):
            return None
        return tinker_wait_message(size_class, self.settings)


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


# ---- a job waiting for workers that all hold Tinker training clients is told why it waits
# (RELIABILITY.md, "The Tinker API: what one tenant may hold").

TINKER_HELD_EVENT = "tinker_held"
# How long a job sent to its queue waits before it is told why: a worker often frees itself
# within a maintenance pass or two, and then there is nothing to explain.
NOTE_AFTER = timedelta(seconds=30)
# Most jobs one sweep tells; the rest are told by the next sweeps.
BATCH = 1000


def note_jobs_waiting_for_tinker(sessions: sessionmaker[Session], settings: Settings) -> list[str]:
    """Write the `tinker_held` event of every job waiting for a size class whose workers all
    hold Tinker training clients; returns the ids of the jobs told."""
    with session_scope(sessions) as session:
        held = {
            queue_for(c.queue_name, c.devices): c
            for c in workers_seen(session, settings).held_by_tinker()
        }
        if not held:
            return []
        waiting = jobs_repo.waiting_without_event(
            session,
            queues=held,
            queued_before=utcnow() - NOTE_AFTER,
            event=TINKER_HELD_EVENT,
            limit=BATCH,
        )
        rows = [(job_id, attempt, held[queue]) for job_id, attempt, queue in waiting]
    told: list[str] = []
    for job_id, attempt, size_class in rows:
        # One unit of work per job: concurrent sweeps (every worker runs one) decide about a
        # job one at a time, so it is told once.
        with session_scope(sessions) as session:
            if _tell(session, job_id=job_id, attempt=attempt, held=size_class, settings=settings):
                told.append(job_id)
    return told


def _tell(
    session: Session, *, job_id: str, attempt: int, held: SizeClassSeen, settings: Settings
) -> bool:
    """Write the job's event unless it is no longer queued at `attempt` or was told already."""
    if not jobs_repo.hold_queued(session, job_id=job_id, attempt=attempt):
        return False
    if events_repo.has_event(session, job_id=job_id, event=TINKER_HELD_EVENT, attempt=attempt):
        return False
    events_repo.insert_new(
        session,
        event=JobEvent(
            job_id=job_id,
            attempt=attempt,
            type=TINKER_HELD_EVENT,
            level="warning",
            message=tinker_wait_message(held, settings),
            data={
                "devices": held.devices,
                "workers": held.workers,
                "tinker_idle_release_s": settings.tinker_idle_release_s,
            },
            created_at=utcnow(),
        ),
    )
    return True
