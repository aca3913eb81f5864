"""FastAPI dependencies: process state, the request's unit of work, the authenticated principal,
and loaders that answer 404 (so no route looks an object up, or checks its owner, by hand)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import Depends, Header, Path, Request
from sqlalchemy.orm import Session

from app.db import session_scope
from app.models import File, Job, WebhookEndpoint
from app.services import files as files_service
from app.services import jobs as jobs_service
from app.services import webhooks as webhooks_service
from app.services.keys import Principal, authenticate
from app.state import AppState

JobId = Annotated[str, Path(max_length=64, description="Job id.")]
FileId = Annotated[str, Path(max_length=64, description="File id.")]
WebhookId = Annotated[str, Path(max_length=64, description="Webhook endpoint id.")]


async def get_state(request: Request) -> AppState:
    """Async because it never blocks: FastAPI runs a plain `def` dependency in the threadpool,
    a thread hop per request for an attribute read."""
    state: AppState = request.app.state.grpo
    return state


StateDep = Annotated[AppState, Depends(get_state)]


async def request_slot(state: StateDep) -> AsyncIterator[None]:
    """Wait (on the event loop) for one of this process's unit-of-work slots
    (app.state.RequestSlots says why); held until the session below has committed."""
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


def get_principal(
    session: SessionDep,
    state: StateDep,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Principal:
    """The caller's key and project (401 otherwise), within its request rate (429 otherwise).

    Every authenticated route depends on this, so every one is rate limited; the health checks
    and the dashboard's static files do not, and are not. The limit is counted after the key is
    verified, so nobody can spend another tenant's budget by sending its key prefix."""
    principal = authenticate(session, authorization=authorization)
    state.limits.requests.check(principal.key_id)
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def get_job(job_id: JobId, principal: PrincipalDep, session: SessionDep) -> Job:
    """The caller's job named in the path, or 404 (param `job_id`)."""
    return jobs_service.get_job(session, project_id=principal.project_id, job_id=job_id)


def get_file(file_id: FileId, principal: PrincipalDep, session: SessionDep) -> File:
    """The caller's file named in the path, or 404 (param `file_id`)."""
    return files_service.get_file(session, project_id=principal.project_id, file_id=file_id)


def get_webhook(
    webhook_id: WebhookId, principal: PrincipalDep, session: SessionDep
) -> WebhookEndpoint:
    """The caller's webhook endpoint named in the path, or 404 (param `webhook_id`)."""
    return webhooks_service.get_endpoint(
        session, project_id=principal.project_id, endpoint_id=webhook_id
    )


JobDep = Annotated[Job, Depends(get_job)]
FileDep = Annotated[File, Depends(get_file)]
WebhookDep = Annotated[WebhookEndpoint, Depends(get_webhook)]
