"""GET /v1/stream: one server-sent event stream per project, so a page listing jobs (the
dashboard's job list) is told when to reload instead of polling.

It sends `jobs` whenever the project's jobs change (created, deleted, a status change, a step
finished; `app.jobs.repository.project_activity`), first once on connecting, with the time of
the change; the client then reads the list it shows. Like the per-job stream it is its own
boundary: each check is one short read transaction, no connection is held while it waits, and
it counts against the key's and the process's stream caps (EventStreamResponse)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import APIRouter
from sqlalchemy.orm import Session, sessionmaker
from starlette.responses import StreamingResponse

from app.core.clock import utcnow
from app.core.db import session_scope
from app.core.deps import StateDep
from app.core.responses import ERRORS, SSE_RESPONSES
from app.jobs import repository as jobs_repo
from app.progress.stream import EventStreamResponse, sse_message
from app.sessions.deps import PrincipalDep

router = APIRouter(prefix="/v1", tags=["jobs"], responses=ERRORS)


def _activity(sessions: sessionmaker[Session], project_id: str) -> tuple[Any, ...]:
    with session_scope(sessions) as session:
        return jobs_repo.project_activity(session, project_id=project_id)


async def project_changes(
    sessions: sessionmaker[Session], project_id: str, *, heartbeat_s: float, poll_s: float
) -> AsyncIterator[str]:
    seen: tuple[Any, ...] | None = None
    last_sent = time.monotonic()
    yield "retry: 2000\n\n"
    while True:
        activity = await anyio.to_thread.run_sync(_activity, sessions, project_id)
        if activity != seen:
            seen = activity
            yield sse_message("jobs", {"at": utcnow().isoformat(), "jobs": activity[0]}, None)
            last_sent = time.monotonic()
        elif time.monotonic() - last_sent >= heartbeat_s:
            yield ": heartbeat\n\n"
            last_sent = time.monotonic()
        await anyio.sleep(poll_s)


@router.get(
    "/stream",
    summary="The project's change stream (SSE): `jobs` whenever one of its jobs changes",
    response_class=StreamingResponse,
    responses=SSE_RESPONSES,
)
def stream(principal: PrincipalDep, state: StateDep) -> EventStreamResponse:
    body = project_changes(
        state.sessions,
        principal.project_id,
        heartbeat_s=state.settings.sse_heartbeat_seconds,
        poll_s=state.settings.sse_poll_seconds,
    )
    return EventStreamResponse(body, slots=state.limits.streams, key_id=principal.key_id)
