"""Worker sightings (table ``workers``): each worker process rewrites its row every maintenance
pass (worker.maintenance.announce_worker); the API reads which size classes were seen lately
(app.jobs.size_classes)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from app.core.models import WorkerSighting


def announce(session: Session, *, name: str, queue_name: str, devices: int, now: datetime) -> None:
    """Write (or rewrite) the worker's row, seen `now`."""
    row = session.get(WorkerSighting, name)
    if row is None:
        session.add(
            WorkerSighting(
                name=name, queue_name=queue_name, devices=devices, started_at=now, last_seen_at=now
            )
        )
        return
    row.queue_name, row.devices, row.last_seen_at = queue_name, devices, now


def forget_before(session: Session, *, queue_name: str, before: datetime) -> None:
    """Delete the rows of the deployment's workers last seen before `before` (gone for good)."""
    session.execute(
        delete(WorkerSighting).where(
            WorkerSighting.queue_name == queue_name, WorkerSighting.last_seen_at < before
        )
    )


def device_classes_seen(session: Session, *, queue_name: str, since: datetime) -> frozenset[int]:
    """The device counts of the deployment's workers seen at or after `since`."""
    rows = session.scalars(
        select(WorkerSighting.devices)
        .where(WorkerSighting.queue_name == queue_name, WorkerSighting.last_seen_at >= since)
        .distinct()
    )
    return frozenset(int(devices) for devices in rows)
