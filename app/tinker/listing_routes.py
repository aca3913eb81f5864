"""GET /v1/tinker/sessions: the project's Tinker sessions and their training clients, read-only,
for the dashboard (dashboard/tinker.js) and API clients. Authenticated and rate limited like
every /v1 route (a key or the dashboard's session cookie); the Tinker API itself is /api/v1
(app.tinker.routes)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.core.deps import SessionDep, StateDep
from app.core.responses import ERRORS
from app.sessions.deps import PrincipalDep
from app.tinker.listing_schemas import TinkerSessionList
from app.tinker.presenters import MODELS_PER_SESSION, session_page

router = APIRouter(prefix="/v1/tinker", tags=["tinker"], responses=ERRORS)


@router.get(
    "/sessions",
    response_model=TinkerSessionList,
    summary="List Tinker sessions, newest first",
    description="The project's sessions of the Tinker API (docs/tinker.md): when each was "
    "created and last sent a heartbeat, whether it is live, and its newest training clients "
    f"(at most {MODELS_PER_SESSION}) with their base model, LoRA rank, status, last saved state "
    "and the calls they applied.",
)
def list_sessions(
    principal: PrincipalDep,
    session: SessionDep,
    state: StateDep,
    after: Annotated[
        str | None, Query(max_length=64, description="Cursor: the last session id seen.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> TinkerSessionList:
    return session_page(
        session,
        project_id=principal.project_id,
        ttl_s=state.settings.tinker_session_ttl_s,
        after=after,
        limit=limit,
    )
