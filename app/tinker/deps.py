"""The Tinker SDK's caller: ``X-API-Key: tml-<a project's API key>``. The SDK refuses, before
sending anything, a key without the ``tml-`` prefix; behind the prefix is one of the project's
own keys (``grpo keys create --tinker`` prints it so), verified, revoked and rate limited like
every other key."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header

from app.core.db import session_scope
from app.core.deps import StateDep
from app.core.errors import Unauthorized
from app.sessions.deps import revocations_of
from app.sessions.service import Principal, authenticate

TINKER_KEY_PREFIX = "tml-"

ApiKeyHeader = Annotated[
    str | None, Header(alias="X-API-Key", include_in_schema=False, max_length=512)
]


def tinker_key(project_key: str) -> str:
    """The key the Tinker SDK takes for a project key."""
    return f"{TINKER_KEY_PREFIX}{project_key}"


def get_tinker_principal(state: StateDep, key: ApiKeyHeader = None) -> Principal:
    """The project of ``X-API-Key`` (401 otherwise), within its key's request rate. Verified in
    a unit of work of its own (a cached key needs none): retrieve_future holds its poll open
    without holding a database session or a request slot."""
    if not key or not key.startswith(TINKER_KEY_PREFIX):
        raise Unauthorized(
            "missing or invalid API key; send X-API-Key: tml-<key> (grpo keys create --tinker)"
        )
    with session_scope(state.sessions) as session:
        principal = authenticate(
            session,
            authorization=f"Bearer {key[len(TINKER_KEY_PREFIX) :]}",
            revocations=revocations_of(state),
        )
    state.limits.requests.check(principal.key_id)
    return principal


TinkerPrincipalDep = Annotated[Principal, Depends(get_tinker_principal)]
