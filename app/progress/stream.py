"""Server-sent events of one job: status changes, events and per-step metrics.

Resumable without gaps or duplicates: every message's id is the cursor `<event id>.<step>` after
it, i.e. the last job event and the last metric step the client has. A client reconnecting with
`Last-Event-ID: 41.7` gets events with id > 41 and metrics with step > 7, read from the database.

A stream lives for minutes, so it is its own boundary: every poll is one short read transaction
(`session_scope`), and no session or connection is held while it waits. Open streams are
capped per API key and per process (`EventStreamResponse`, counted by app.core.ratelimit).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from sqlalchemy.orm import Session, sessionmaker
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.core.clock import as_utc, utcnow
from app.core.db import session_scope
from app.core.errors import MalformedHeader
from app.core.ids import MAX_ID, MAX_STEP, parse_number
from app.core.leases import STREAM_RENEW_S, StreamSlot, StreamSlots
from app.core.live import TailWaiter
from app.jobs import events_repository as events_repo
from app.jobs import repository as jobs_repo
from app.jobs.presenters import event_out
from app.jobs.transitions import TERMINAL, JobStatus
from app.progress import repository as progress_repo

BATCH = 500


@dataclass
class Cursor:
    event_id: int = 0
    step: int = 0

    def __str__(self) -> str:
        return f"{self.event_id}.{self.step}"

    @classmethod
    def parse(cls, raw: str | None) -> Cursor:
        """The cursor a client sent back (Last-Event-ID or ?after=); MalformedHeader (400)
        unless it is two whole numbers a database column can hold, as this stream sends."""
        if not raw:
            return cls()
        event_id, _, step = raw.partition(".")
        numbers = parse_number(event_id), parse_number(step, MAX_STEP)
        if numbers[0] is None or numbers[1] is None:
            raise MalformedHeader(
                "Last-Event-ID must look like '<event id>.<step>' (as sent by this stream): "
                f"whole numbers, the event id at most {MAX_ID} and the step at most {MAX_STEP}",
                param="Last-Event-ID",
            )
        return cls(numbers[0], numbers[1])


@dataclass
class Batch:
    messages: list[tuple[str, dict[str, Any], Any]]  # (event name, data, sort key)
    status: str
    drained: bool


def _read(sessions: sessionmaker[Session], job_id: str, cursor: Cursor) -> Batch:
    with session_scope(sessions) as session:
        job = jobs_repo.get(session, job_id=job_id)
        status = job.status if job else JobStatus.FAILED.value
        events, more_events = events_repo.list_after(
            session, job_id=job_id, after=cursor.event_id, limit=BATCH
        )
        metrics = progress_repo.metrics_after(
            session, job_id=job_id, after_step=cursor.step, limit=BATCH
        )
        messages: list[tuple[str, dict[str, Any], Any]] = []
        for event in events:
            body = event_out(event).model_dump(mode="json")
            name = "status" if event.type == "status" else "event"
            messages.append((name, body, (as_utc(event.created_at), 0, event.id)))
        for row in metrics:
            body = {"step": row.step, "attempt": row.attempt, "values": row.values}
            messages.append(("metrics", body, (as_utc(row.created_at), 1, row.step)))
    messages.sort(key=lambda m: m[2])
    drained = not more_events and len(metrics) < BATCH
    return Batch(messages, status, drained)


def sse_message(name: str, data: dict[str, Any], cursor: Cursor | None) -> str:
    """One SSE message; `cursor` None for control messages that must not move Last-Event-ID."""
    head = f"id: {cursor}\n" if cursor is not None else ""
    return f"{head}event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def job_events(
    sessions: sessionmaker[Session],
    job_id: str,
    cursor: Cursor,
    *,
    redis_url: str | None,
    heartbeat_s: float,
    poll_s: float,
) -> AsyncIterator[str]:
    waiter = TailWaiter(redis_url, job_id)
    last_sent = time.monotonic()
    try:
        yield "retry: 2000\n\n"
        while True:
            batch = await anyio.to_thread.run_sync(_read, sessions, job_id, cursor)
            for name, data, _ in batch.messages:
                if name == "metrics":
                    cursor.step = max(cursor.step, int(data["step"]))
                else:
                    cursor.event_id = max(cursor.event_id, int(data["id"]))
                yield sse_message(name, data, cursor)
                last_sent = time.monotonic()
            if batch.status in TERMINAL and batch.drained:
                yield sse_message("end", {"status": batch.status, "at": utcnow().isoformat()}, None)
                return
            if batch.messages and not batch.drained:
                continue
            if time.monotonic() - last_sent >= heartbeat_s:
                yield ": heartbeat\n\n"
                last_sent = time.monotonic()
            await waiter.wait(min(poll_s, heartbeat_s))
    finally:
        # Shielded: on a disconnect this runs inside the cancelled body, where an unshielded
        # await would be cancelled too and leave the Redis connection open.
        with anyio.CancelScope(shield=True):
            await waiter.close()


class EventStreamResponse(StreamingResponse):
    """The SSE response. It takes a stream slot before its first byte (TooManyRequests, a 429
    with Retry-After rendered by the app's error handler, when the key or this process has too
    many streams open) and gives it back when the stream ends for any reason: the job finished,
    the client went away (Starlette cancels the body on `http.disconnect`), or the server
    stops. Taking it here rather than in the route leaves no moment where a slot is held but no
    response will run to release it."""

    def __init__(self, body: AsyncIterator[str], *, slots: StreamSlots, key_id: str) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._slots = slots
        self._key_id = key_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with anyio.CancelScope(shield=True):  # a slot taken is always released below
            slot = await anyio.to_thread.run_sync(self._slots.acquire, self._key_id)
        try:
            async with anyio.create_task_group() as renewing:
                renewing.start_soon(self._keep_lease, slot)
                try:
                    await super().__call__(scope, receive, send)
                finally:
                    renewing.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._slots.release, slot)

    async def _keep_lease(self, slot: StreamSlot) -> None:
        while True:
            await anyio.sleep(STREAM_RENEW_S)
            await anyio.to_thread.run_sync(self._slots.renew, slot)
