"""/v1/session: the dashboard's sign-in. The key is posted once; the answer sets an HttpOnly,
SameSite=Strict cookie holding a short-lived signed token (app.core.session_tokens) that names the
key, so the page keeps no key where scripts can read it and can follow SSE streams (EventSource
sends cookies, never an Authorization header). app.sessions.deps.get_principal accepts the cookie as a
second way to the same Principal; see README's "Dashboard" section for the threat model."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request, Response
from sqlalchemy.orm import Session

from app.core.deps import SessionDep, StateDep
from app.core.responses import ERRORS, ErrorResponse
from app.sessions.deps import (
    SESSION_COOKIE,
    AuthorizationHeader,
    CsrfHeader,
    PrincipalDep,
    SessionCookie,
    require_csrf_header,
    revocations_of,
)
from app.sessions.schemas import SessionIn, SessionOut
from app.sessions.service import authenticate, end_sessions, project_name

router = APIRouter(prefix="/v1/session", tags=["session"], responses=ERRORS)

# Only the API reads the cookie: the page and its files are public and never get it.
COOKIE_PATH = "/v1"
CSRF_REFUSED: dict[int | str, dict[str, Any]] = {
    403: {
        "model": ErrorResponse,
        "description": "The X-Requested-With header is missing (a cross-site request).",
    }
}


def _out(session: Session, project_id: str, key_id: str, expires_at: int | None) -> SessionOut:
    return SessionOut(
        project_id=project_id,
        project_name=project_name(session, project_id=project_id),
        key_id=key_id,
        via="bearer" if expires_at is None else "cookie",
        expires_at=None if expires_at is None else datetime.fromtimestamp(expires_at, UTC),
    )


@router.post(
    "",
    response_model=SessionOut,
    summary="Sign in: exchange an API key for a session cookie",
    description='Send the key in the body (`{"key": ...}`) or as `Authorization: Bearer`, '
    "and the header `X-Requested-With` (any value). The answer sets the HttpOnly, "
    "SameSite=Strict cookie `grpo_session` (Path=/v1), valid for `GRPO_SESSION_TTL_HOURS` "
    "while the key is not revoked.",
    responses=CSRF_REFUSED,
)
def sign_in(
    request: Request,
    response: Response,
    session: SessionDep,
    state: StateDep,
    body: Annotated[SessionIn | None, Body()] = None,
    authorization: AuthorizationHeader = None,
    csrf_header: CsrfHeader = None,
) -> SessionOut:
    # Also here, so no other site can sign a visitor into the site's own project (login CSRF).
    require_csrf_header(csrf_header)
    if authorization is None and body is not None and body.key is not None:
        authorization = f"Bearer {body.key}"
    principal = authenticate(
        session, authorization=authorization, revocations=revocations_of(state)
    )
    state.limits.requests.check(principal.key_id)
    token, claims = state.session_tokens.issue(principal.key_id)
    secure = state.settings.session_cookie_secure
    response.set_cookie(
        SESSION_COOKIE,
        token,
        max_age=int(state.session_tokens.ttl_s),
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https" if secure is None else secure,
    )
    response.headers["Cache-Control"] = "no-store"
    return _out(session, principal.project_id, principal.key_id, claims.expires_at)


@router.get(
    "",
    response_model=SessionOut,
    summary="Who am I: the project and key of this request's credentials",
)
def who_am_i(
    principal: PrincipalDep,
    session: SessionDep,
    state: StateDep,
    authorization: AuthorizationHeader = None,
    session_cookie: SessionCookie = None,
) -> SessionOut:
    expires_at = None
    if authorization is None and session_cookie is not None:
        claims = state.session_tokens.verify(session_cookie)
        expires_at = claims.expires_at if claims is not None else None
    return _out(session, principal.project_id, principal.key_id, expires_at)


@router.delete(
    "",
    status_code=204,
    summary="Sign out: end the key's sessions and clear the cookie",
    description="With a valid session cookie, every session of its key issued until now ends "
    "(in every browser, at once in every API process), so a copy of the token is refused "
    "too. Needs no other credentials: without a valid cookie it only clears the cookie. With "
    "a cookie it is a write authenticated by the cookie, so it needs `X-Requested-With` (any "
    "value) like every other one: 403 without it.",
    responses=CSRF_REFUSED,
)
def sign_out(
    session: SessionDep,
    state: StateDep,
    session_cookie: SessionCookie = None,
    csrf_header: CsrfHeader = None,
) -> Response:
    if session_cookie is not None:
        # Else any site could end a visitor's sessions with a cross-site DELETE (a nuisance
        # the README's promise for cookie-authenticated writes rules out).
        require_csrf_header(csrf_header)
    claims = state.session_tokens.verify(session_cookie) if session_cookie else None
    if claims is not None:
        state.limits.requests.check(claims.key_id)  # each sign-out is a write: bounded too
        end_sessions(session, key_id=claims.key_id, revocations=revocations_of(state))
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")
    return response
