"""FastAPI dependencies every domain shares: process state and the request's unit of work. The
authenticated principal is app.sessions.deps; each domain loads its own objects (app.jobs.deps,
app.files.deps, app.webhooks.deps: loaders that answer 404, so no route looks an object up, or
checks its owner, by hand)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from app.core.db import session_scope
from app.core.state import AppState


async def get_state(request: Request) -> AppState:
    """Async because it never blocks: FastAPI runs a plain `def` dependency in the threadpool,
    a thread hop per request for an attribute read."""
    state: AppState = request.app.state.grpo
    return state


StateDep = Annotated[AppState, Depends(get_state)]


async def request_slot(state: StateDep) -> AsyncIterator[None]:
    """Wait (on the event loop) for one of this process's unit-of-work slots
    (app.core.state.RequestSlots says why); held until the session below has committed."""
    async with state.slots.semaphore():
        yield


def get_session(
    state: StateDep, _slot: Annotated[None, Depends(request_slot, scope="function")]
) -> Iterator[Session]:
    """The request's unit of work: commit when the route returned, roll back when it raised.

    Used with scope="function": FastAPI ends it as soon as the route function returns, before
    the response is sent. So a client never holds a 201 for a row that is not committed yet,
    after-commit work (sending a new job to the broker) is done when it reads the answer, and a
    streaming response (SSE) holds no session while it streams."""
    with session_scope(state.sessions) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
