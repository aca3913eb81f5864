"""The Tinker SDK's caller: ``X-API-Key: tml-<a project's API key>``. The SDK refuses, before
sending anything, a key without the ``tml-`` prefix; behind the prefix is one of the project's
own keys (``grpo keys create --tinker`` prints it so), verified, revoked and rate limited like
every other key.

And the bodies of its calls, read (bounded) by async dependencies, so that the routes that use
the database are plain functions, run in the threadpool: a route on the event loop waiting for
the database (SQLite's one writer, a row lock) would stall every other request, including the
commit of the request it waits for (tinker-cookbook's concurrent ``asample`` calls deadlocked
the embedded default so, until the session expired)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from app.core.db import session_scope
from app.core.deps import StateDep
from app.core.errors import InvalidRequest, PayloadTooLarge, Unauthorized
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


# A JSON body of the Tinker API (the largest: a sample's prompt of MAX_PROMPT_TOKENS ids).
MAX_JSON_BYTES = 2_000_000


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to pass ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body is over {limit} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"the body is over {limit} bytes")
    return body


async def json_body(request: Request) -> bytes:
    return await read_body(request, MAX_JSON_BYTES)


async def forward_backward_body(request: Request, state: StateDep) -> bytes:
    """A forward_backward call's protobuf body, within GRPO_TINKER_MAX_BODY_BYTES."""
    if request.headers.get("content-encoding"):
        raise InvalidRequest("compressed bodies are not accepted (proto_compress_fwdbwd: false)")
    return await read_body(request, state.settings.tinker_max_body_bytes)


JsonBody = Annotated[bytes, Depends(json_body)]
ForwardBackwardBody = Annotated[bytes, Depends(forward_backward_body)]
