"""What a running API process holds: settings, engine, session factory, dispatcher, and the
fair-use counters (request rate, open streams)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from app.core.db import make_engine, make_session_factory, warm_pool
from app.core.models import Base
from app.core.queue import CeleryDispatcher, Dispatcher
from app.core.ratelimit import Limits, build_limits
from app.core.session_tokens import SessionTokens, load_or_create_secret
from app.core.settings import Settings
from grading.fair_slots import FairSlots, SlotNames
from grading.sandbox import SandboxCapacity, build_sandbox_settings


class RequestSlots:
    """At most `size` requests of this process inside their unit of work at once.

    A request's session keeps its pooled connection (and any row lock it took) between the
    thread hops FastAPI runs a sync dependency, the route and the commit in, and each hop
    needs one of the threadpool's 40 threads. With more requests in flight than the pool holds,
    threads blocked on the pool (or on a row lock) held every thread while the connection
    holders waited for one to commit in: the API stalled under load (bench/load_create.py).
    Waiting for a slot happens on the event loop, holding nothing. One semaphore per event
    loop (a test client runs its own loop)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._loop: asyncio.AbstractEventLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None

    def semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._loop is not loop:
            self._loop, self._semaphore = loop, asyncio.Semaphore(self.size)
        return self._semaphore


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    dispatcher: Dispatcher
    limits: Limits
    # Idempotency claims commit on their own (each statement is its own transaction) while
    # the request's transaction holds a pooled connection, so they get a pool of their own:
    # sharing one pool, N requests holding its N connections and each waiting for a second one
    # deadlocked the API under load (every request then timed out after 30 s;
    # bench/load_create.py found it).
    claims: sessionmaker[Session]
    slots: RequestSlots
    # Signs and checks the dashboard's session cookies (app.sessions.routes).
    session_tokens: SessionTokens
    # The python-grader sandboxes this process runs at once, per project and in all
    # (GRPO_SANDBOX_MAX_SANDBOXES*; POST /v1/graders/run).
    sandboxes: SandboxCapacity
    # Dataset uploads this process decodes at once, per project and in all
    # (GRPO_MAX_CONCURRENT_UPLOADS*; POST /v1/files): each may take the row budget.
    uploads: FairSlots


UPLOAD_SLOTS = SlotNames(
    what="dataset uploads",
    total="GRPO_MAX_CONCURRENT_UPLOADS",
    per_project="GRPO_MAX_CONCURRENT_UPLOADS_PER_PROJECT",
    queue_timeout="GRPO_UPLOAD_QUEUE_TIMEOUT_S",
)


def warm_pools(state: AppState) -> int:
    """Open both pools' kept connections with the tables in their backends' caches
    (`app.core.db.warm_pool`); returns how many connections were opened."""
    tables = [table.name for table in Base.metadata.sorted_tables]
    claims_engine = state.claims.kw["bind"]
    return warm_pool(state.engine, tables) + warm_pool(claims_engine, tables)


# A pooled connection unused this long is pinged before a request gets it (app.core.db
# .ping_idle_connections): under load none is, so no request pays a ping round trip.
PING_AFTER_IDLE_S = 0.25


def build_state(settings: Settings, dispatcher: Dispatcher | None = None) -> AppState:
    engine = make_engine(settings.resolved_database_url, ping_after_idle_s=PING_AFTER_IDLE_S)
    sessions = make_session_factory(engine)
    dispatcher = dispatcher or CeleryDispatcher(settings)
    claims = make_session_factory(
        make_engine(
            settings.resolved_database_url,
            pool_size=2,
            max_overflow=8,
            ping_after_idle_s=PING_AFTER_IDLE_S,
            # A claim is one statement: no BEGIN and COMMIT round trips around it.
            autocommit=True,
        )
    )
    return AppState(
        settings=settings,
        engine=engine,
        sessions=sessions,
        dispatcher=dispatcher,
        limits=build_limits(settings),
        claims=claims,
        # As many as the pool keeps open: more in flight would only wait on the pool, or open
        # and close overflow connections (a new Postgres backend each time).
        slots=RequestSlots(max(1, int(getattr(engine.pool, "size", lambda: 10)()))),
        session_tokens=SessionTokens(
            load_or_create_secret(settings.resolved_session_secret_file, settings.session_secret),
            ttl_s=settings.session_ttl_hours * 3600,
        ),
        sandboxes=SandboxCapacity.from_settings(build_sandbox_settings()),
        uploads=FairSlots(
            total=settings.max_concurrent_uploads,
            per_project=min(
                settings.max_concurrent_uploads_per_project, settings.max_concurrent_uploads
            ),
            queue_timeout_s=settings.upload_queue_timeout_s,
            names=UPLOAD_SLOTS,
        ),
    )
