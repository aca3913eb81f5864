"""/v1/keys: the project's API keys, and revoking one. A key reaches only its own project's
keys (another project's id is the same 404 as an unknown one); a revoked key answers 401 from
the revocation's commit on, in every API process (app.sessions.revocations)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from app.core.clock import as_utc, utcnow
from app.core.deps import SessionDep, StateDep
from app.core.models import ApiKey
from app.core.responses import ERRORS
from app.sessions.deps import PrincipalDep, revocations_of
from app.sessions.schemas import KeyList, KeyOut
from app.sessions.service import project_key, project_keys, revoke_key

router = APIRouter(prefix="/v1/keys", tags=["keys"], responses=ERRORS)

KeyId = Annotated[str, Path(max_length=64, description="The key's id (key_...).")]


def key_out(key: ApiKey) -> KeyOut:
    return KeyOut(
        id=key.id,
        prefix=key.prefix,
        name=key.name,
        created_at=as_utc(key.created_at) or utcnow(),
        revoked_at=as_utc(key.revoked_at),
    )


@router.get("", response_model=KeyList, summary="The project's API keys (never their secrets)")
def list_keys(principal: PrincipalDep, session: SessionDep) -> KeyList:
    keys = project_keys(session, project_id=principal.project_id)
    return KeyList(data=[key_out(k) for k in keys])


@router.delete(
    "/{key_id}",
    response_model=KeyOut,
    summary="Revoke a key of this project (idempotent)",
    description="From the answer on, the key and its dashboard sessions get 401 in every API "
    "process. A key may revoke itself. Another project's key is a 404, like an unknown id.",
)
def revoke(key_id: KeyId, principal: PrincipalDep, session: SessionDep, state: StateDep) -> KeyOut:
    key = project_key(session, project_id=principal.project_id, key_id=key_id)
    return key_out(revoke_key(session, key=key, revocations=revocations_of(state)))
