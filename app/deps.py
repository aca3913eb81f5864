"""FastAPI dependencies: process state, a per-request session, the authenticated principal."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session

from app.services.keys import Principal, authenticate
from app.state import AppState


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.grpo
    return state


def get_session(state: Annotated[AppState, Depends(get_state)]) -> Iterator[Session]:
    session = state.sessions()
    try:
        yield session
    finally:
        session.close()


def get_principal(
    session: Annotated[Session, Depends(get_session)],
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Principal:
    principal = authenticate(session, authorization)
    session.commit()
    return principal


StateDep = Annotated[AppState, Depends(get_state)]
SessionDep = Annotated[Session, Depends(get_session)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
