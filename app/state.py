"""What a running API process holds: settings, engine, session factory, dispatcher."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.db import make_engine, make_session_factory
from app.queue import CeleryDispatcher, Dispatcher
from app.settings import Settings


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    dispatcher: Dispatcher


def build_state(settings: Settings, dispatcher: Dispatcher | None = None) -> AppState:
    engine = make_engine(settings.resolved_database_url)
    return AppState(
        settings=settings,
        engine=engine,
        sessions=make_session_factory(engine),
        dispatcher=dispatcher or CeleryDispatcher(settings),
    )
