"""The authenticated caller: an API key (Authorization: Bearer) or the dashboard's session
cookie, within its request rate; and the cross-site guard a cookie-signed write must pass."""

from __future__ import annotations

from typing import Annotated

from fastapi import Cookie, Depends, Header, Request

from app.core.deps import SessionDep, StateDep
from app.core.errors import CrossSiteRefused, Unauthorized
from app.core.state import AppState
from app.sessions.revocations import RevocationEpoch, revocation_epoch
from app.sessions.service import Principal, authenticate, authenticate_session

# The dashboard's session cookie (app.sessions.routes) and the header a cookie-authenticated
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


def _authenticated(
    request: Request,
    session: SessionDep,
    state: StateDep,
    authorization: AuthorizationHeader = None,
    session_cookie: SessionCookie = None,
    csrf_header: CsrfHeader = None,
) -> Principal:
    """The caller's key and project (401 otherwise), not yet counted against a rate limit.

    Two ways in, to the same Principal: `Authorization: Bearer <key>` (API clients; it wins
    when both are sent), or the dashboard's session cookie, a signed token naming a key that is
    looked up on use (so a revoked key's sessions stop working). A cookie-authenticated request
    that is not GET/HEAD must carry CSRF_HEADER (`require_csrf_header`); Bearer requests need
    nothing more, as no other site can make a browser send our key."""
    revocations = revocations_of(state)
    if authorization is not None or session_cookie is None:
        return authenticate(session, authorization=authorization, revocations=revocations)
    if request.method not in SAFE_METHODS:
        require_csrf_header(csrf_header)
    claims = state.session_tokens.verify(session_cookie)
    if claims is None:
        raise Unauthorized("the session has expired or is not valid; sign in again")
    return authenticate_session(
        session,
        key_id=claims.key_id,
        issued_at_ms=claims.issued_at_ms,
        revocations=revocations,
    )


def revocations_of(state: AppState) -> RevocationEpoch:
    """The revocation counter this process shares with the others (through the settings'
    Redis; app.sessions.revocations)."""
    return revocation_epoch(state.settings.resolved_redis_url)


AuthenticatedDep = Annotated[Principal, Depends(_authenticated)]


def get_principal(principal: AuthenticatedDep, state: StateDep) -> Principal:
    """The caller (`_authenticated`), within its request rate (429 otherwise).

    Every authenticated route depends on this (or on `get_inference_principal`), so every one
    is rate limited; the health checks and the dashboard's static files do not, and are not.
    The limit is counted after the key is verified, so nobody can spend another tenant's budget
    by sending its key prefix."""
    state.limits.requests.check(principal.key_id)
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def get_inference_principal(principal: AuthenticatedDep, state: StateDep) -> Principal:
    """The caller of chat and completions, within the key's inference request rate
    (GRPO_INFERENCE_RATE_LIMIT_*), a budget apart from the rest of the API's."""
    state.limits.inference_requests.check(principal.key_id)
    return principal


InferencePrincipalDep = Annotated[Principal, Depends(get_inference_principal)]
