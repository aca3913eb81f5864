"""The FastAPI application factory. `app.main:create_app` is what uvicorn serves."""

from __future__ import annotations

from fastapi import FastAPI

from app.core import error_handlers, log_redaction
from app.core.limits import BodySizeLimit
from app.core.queue import Dispatcher
from app.core.request_guard import RejectNul
from app.core.settings import Settings, build_settings
from app.core.state import build_state
from app.dashboard import routes as dashboard
from app.files import routes as files
from app.fine_tuning import routes as fine_tuning
from app.gateway import routes as gateway
from app.graders import routes as graders
from app.health import routes as health
from app.jobs import dispatch
from app.jobs import routes as jobs
from app.jobs.service import JobCreation
from app.progress import project_stream
from app.progress import routes as progress
from app.sessions import keys_routes
from app.sessions import routes as session
from app.tinker import listing_routes as tinker_listing
from app.tinker import routes as tinker
from app.tinker import sampling_routes as tinker_sampling
from app.usage import routes as usage
from app.webhooks import routes as webhooks

API_DESCRIPTION = """\
GRPO fine-tuning as a service. Submit a job spec (model, prompts, graders, GRPO settings),
then follow its status, events and metrics. Every request needs `Authorization: Bearer <key>`
(the dashboard signs in once with POST /v1/session and then sends its session cookie).
Errors always look like `{"error": {"type", "message", "param"}}`.
"""


def create_app(settings: Settings | None = None, dispatcher: Dispatcher | None = None) -> FastAPI:
    settings = settings or build_settings()
    # /docs is the dashboard router's (Swagger UI from npm under the dashboard's CSP); FastAPI's
    # own pages load their scripts from a CDN with inline code, on the session cookie's origin.
    app = FastAPI(
        title="grpo-service",
        version="0.1.0",
        description=API_DESCRIPTION,
        docs_url=None,
        redoc_url=None,
    )
    state = build_state(settings, dispatcher)
    # Every unit of work of this process dispatches within the per-project cap.
    dispatch.install(
        state.sessions, state.dispatcher, max_per_project=settings.max_dispatched_per_project
    )
    app.state.grpo = state
    # The idempotent create both create routes use (POST /v1/jobs, POST /v1/fine_tuning/jobs).
    app.state.job_creation = JobCreation(
        claims=state.claims, dispatcher=state.dispatcher, settings=settings
    )
    log_redaction.install()
    error_handlers.install(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    # Text Postgres cannot store never reaches a query: a 422 naming the parameter, not a 500.
    app.add_middleware(RejectNul)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(progress.router)
    app.include_router(project_stream.router)
    app.include_router(files.router)
    app.include_router(graders.router)
    app.include_router(fine_tuning.router)
    app.include_router(gateway.router)
    app.include_router(gateway.completions_router)
    app.include_router(webhooks.router)
    app.include_router(usage.router)
    app.include_router(session.router)
    app.include_router(keys_routes.router)
    app.include_router(tinker.router)
    app.include_router(tinker_sampling.router)
    app.include_router(tinker_listing.router)
    app.include_router(dashboard.router)
    return app
