"""The inference processes' registry (table ``inference_servers``): each `grpo inference` process
writes its row at start and every heartbeat and removes it when it stops; the gateway reads the
fresh rows to route a request (app.gateway.protocol says what the rows hold)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from app.core.clock import as_utc, utcnow
from app.core.models import InferenceServer
from app.gateway.protocol import ANY_BASE, FRESH_S


def register(
    session: Session, *, server_id: str, control_url: str, bases: list[str], state: dict[str, Any]
) -> None:
    """Write (or rewrite) the server's row with a fresh heartbeat."""
    now = utcnow()
    row = session.get(InferenceServer, server_id)
    if row is None:
        session.add(
            InferenceServer(
                id=server_id,
                control_url=control_url,
                bases=bases,
                state=state,
                started_at=now,
                heartbeat_at=now,
            )
        )
        return
    row.control_url, row.bases, row.state, row.heartbeat_at = control_url, bases, state, now


def unregister(session: Session, *, server_id: str) -> None:
    session.execute(delete(InferenceServer).where(InferenceServer.id == server_id))


def fresh_servers(session: Session, *, fresh_s: float = FRESH_S) -> list[InferenceServer]:
    """The servers whose heartbeat is younger than ``fresh_s``, oldest start first (a stable
    order for routing)."""
    since = utcnow() - timedelta(seconds=fresh_s)
    rows = session.scalars(
        select(InferenceServer)
        .where(InferenceServer.heartbeat_at >= since)
        .order_by(InferenceServer.started_at, InferenceServer.id)
    ).all()
    # SQLite hands back naive datetimes: compare in UTC (the filter above already did).
    return [r for r in rows if (as_utc(r.heartbeat_at) or since) >= since]


def served_base_names(session: Session) -> list[str]:
    """The base models the fresh servers name in their ``bases`` (GRPO_INFERENCE_BASES), sorted;
    ``*`` (any model) names none."""
    names = {str(b) for server in fresh_servers(session) for b in (server.bases or [])}
    return sorted(names - {ANY_BASE})


def remove_stale(session: Session, *, older_than_s: float) -> int:
    """Delete rows of processes gone for ``older_than_s``; how many went."""
    since = utcnow() - timedelta(seconds=older_than_s)
    result = session.execute(delete(InferenceServer).where(InferenceServer.heartbeat_at < since))
    return int(getattr(result, "rowcount", 0) or 0)
