"""FastAPI dependencies: process state, the request's unit of work, the authenticated principal,
and loaders that answer 404 (so no route looks an object up, or checks its owner, by hand)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import Cookie, Depends, Header, Path, Request
from sqlalchemy.orm import Session

from app.core.db import session_scope
from app.core.errors import CrossSiteRefused, Unauthorized
from app.core.models import File, Job, WebhookEndpoint
from app.services import files as files_service
from app.services import jobs as jobs_service
from app.services import webhooks as webhooks_service
from app.services.keys import Principal, authenticate, authenticate_session
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


async def get_job_creation(state: StateDep) -> jobs_service.JobCreation:
    """The process's idempotent create (app.services.jobs.JobCreation), built at start-up."""
    return state.job_creation


JobCreationDep = Annotated[jobs_service.JobCreation, Depends(get_job_creation)]


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


# The dashboard's session cookie (app.routes.session) and the header a cookie-authenticated
# state-changing request must carry.
SESSION_COOKIE = "grpo_session"
CSRF_HEADER = "X-Requested-With"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

AuthorizationHeader = Annotated[str | None, Header(include_in_schema=False)]
# Not length-checked here: an overlong or malformed token is a 401 (SessionTokens.verify).
SessionCookie = Annotated[str | None, Cookie(alias=SESSION_COOKIE, include_in_schema=False)]
CsrfHeader = Annotated[
    str | None, Header(alias=CSRF_HEADER, include_in_schema=False, max_length=64)
]


def require_csrf_header(value: str | None) -> None:
    """A browser sends a custom header cross-origin only after a CORS preflight, which this API
    never grants: a request that carries one came from a script on the dashboard's own origin,
    never from another site's form, link or fetch (which do carry cookies, SameSite aside)."""
    if not (value and value.strip()):
        raise CrossSiteRefused(
            f"a request signed in by the session cookie that changes state must send the "
            f"{CSRF_HEADER} header (any value); or authenticate with Authorization: Bearer <key>",
            param=CSRF_HEADER,
        )


def get_principal(
    request: Request,
    session: SessionDep,
    state: StateDep,
    authorization: AuthorizationHeader = None,
    session_cookie: SessionCookie = None,
    csrf_header: CsrfHeader = None,
) -> Principal:
    """The caller's key and project (401 otherwise), within its request rate (429 otherwise).

    Two ways in, to the same Principal: `Authorization: Bearer <key>` (API clients; it wins
    when both are sent), or the dashboard's session cookie, a signed token naming a key that is
    looked up on use (so a revoked key's sessions stop working). A cookie-authenticated request
    that is not GET/HEAD must carry CSRF_HEADER (`require_csrf_header`); Bearer requests need
    nothing more, as no other site can make a browser send our key.

    Every authenticated route depends on this, so every one is rate limited; the health checks
    and the dashboard's static files do not, and are not. The limit is counted after the key is
    verified, so nobody can spend another tenant's budget by sending its key prefix."""
    if authorization is not None or session_cookie is None:
        principal = authenticate(session, authorization=authorization)
    else:
        if request.method not in SAFE_METHODS:
            require_csrf_header(csrf_header)
        claims = state.session_tokens.verify(session_cookie)
        if claims is None:
            raise Unauthorized("the session has expired or is not valid; sign in again")
        principal = authenticate_session(
            session, key_id=claims.key_id, issued_at_ms=claims.issued_at_ms
        )
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
