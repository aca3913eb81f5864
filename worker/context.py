"""What a worker process holds while it runs: settings, database sessions, the dispatcher, and
the shutdown flag that SIGTERM sets."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker

from app.core.db import make_engine, make_session_factory
from app.core.live import TailPublisher
from app.core.queue import CeleryDispatcher, Dispatcher
from app.jobs import dispatch
from worker.settings import WorkerSettings


@dataclass
class WorkerContext:
    settings: WorkerSettings
    sessions: sessionmaker[Session]
    dispatcher: Dispatcher
    tail: TailPublisher = field(default_factory=lambda: TailPublisher(None))
    shutdown: threading.Event = field(default_factory=threading.Event)
    # The Tinker training clients this process holds now (worker.tinker_model), announced
    # with the worker's row so that a job waiting for its size class can say why.
    held_tinker_models: set[str] = field(default_factory=set)


def build_context(settings: WorkerSettings) -> WorkerContext:
    engine = make_engine(settings.resolved_database_url)
    sessions = make_session_factory(engine)
    dispatcher = CeleryDispatcher(settings)
    # A job this worker ends frees a dispatch slot: its project's next job is sent at once.
    dispatch.install(sessions, dispatcher, max_per_project=settings.max_dispatched_per_project)
    return WorkerContext(
        settings=settings,
        sessions=sessions,
        dispatcher=dispatcher,
        tail=TailPublisher(settings.resolved_redis_url),
    )
