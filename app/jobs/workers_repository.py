"""Worker sightings (table ``workers``): each worker process rewrites its row every maintenance
pass (worker.maintenance.announce_worker); the API and the sweep read which size classes were
seen lately, and whether their workers hold Tinker training clients (app.jobs.size_classes)."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.core.models import WorkerSighting


def announce(
    session: Session,
    *,
    name: str,
    queue_name: str,
    devices: int,
    now: datetime,
    tinker_models: int = 0,
    device: tuple[int, str] | None = None,
) -> None:
    """Write (or rewrite) the worker's row, seen `now`: its size class (`devices`; 0 for a
    worker that takes no jobs), the Tinker training clients it holds and its `device` (one
    device's bytes, its kind)."""
    memory, kind = device if device is not None else (None, None)
    row = session.get(WorkerSighting, name)
    if row is None:
        session.add(
            WorkerSighting(
                name=name,
                queue_name=queue_name,
                devices=devices,
                started_at=now,
                last_seen_at=now,
                tinker_models=tinker_models,
                device_kind=kind,
                device_memory=memory,
            )
        )
        return
    row.queue_name, row.devices, row.last_seen_at = queue_name, devices, now
    row.tinker_models = tinker_models
    row.device_kind, row.device_memory = kind, memory


def forget_before(session: Session, *, queue_name: str, before: datetime) -> None:
    """Delete the rows of the deployment's workers last seen before `before` (gone for good)."""
    session.execute(
        delete(WorkerSighting).where(
            WorkerSighting.queue_name == queue_name, WorkerSighting.last_seen_at < before
        )
    )


class SizeClassSeen(NamedTuple):
    """The workers of one size class of one deployment seen lately."""

    queue_name: str  # the deployment's GRPO_QUEUE_NAME
    devices: int
    workers: int
    holding_tinker: int  # of them, those that held Tinker training clients
    # What their devices are: "cuda" when any announced one, else "cpu", else None (none
    # announced); and the smallest device of that kind (a job's plan must fit every worker).
    device_kind: str | None = None
    device_memory: int | None = None


def size_classes_seen(
    session: Session, *, since: datetime, queue_name: str | None = None
) -> list[SizeClassSeen]:
    """The size classes of the workers that take jobs (a Tinker-only worker announces 0
    devices, no class) seen at or after `since`: of the deployment `queue_name`, or of all."""
    holding = func.count().filter(WorkerSighting.tinker_models > 0)
    cuda = WorkerSighting.device_kind == "cuda"
    cuda_memory = func.min(WorkerSighting.device_memory).filter(cuda)
    any_memory = func.min(WorkerSighting.device_memory)
    query = (
        select(
            WorkerSighting.queue_name,
            WorkerSighting.devices,
            func.count(),
            holding,
            func.count().filter(cuda),
            func.count().filter(WorkerSighting.device_kind.is_not(None)),
            cuda_memory,
            any_memory,
        )
        .where(WorkerSighting.last_seen_at >= since, WorkerSighting.devices > 0)
        .group_by(WorkerSighting.queue_name, WorkerSighting.devices)
    )
    if queue_name is not None:
        query = query.where(WorkerSighting.queue_name == queue_name)
    seen = []
    for q, d, n, h, cudas, announced, cuda_min, any_min in session.execute(query):
        kind = "cuda" if cudas else ("cpu" if announced else None)
        memory = cuda_min if cudas else any_min
        seen.append(
            SizeClassSeen(
                str(q), int(d), int(n), int(h), kind, int(memory) if memory is not None else None
            )
        )
    return seen
