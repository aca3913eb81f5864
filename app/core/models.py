"""SQLAlchemy models: the durable record of projects, keys, jobs and everything a job produces.

Postgres is the source of truth for every job; the broker only carries job ids.
Status is written only by `app.jobs.transitions`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    ColumnElement,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    SQLColumnExpression,
    String,
    Text,
    UniqueConstraint,
    literal_column,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.core.clock import utcnow
from app.core.job_status import QUOTA_COUNTED_STATES
from app.core.model_base import Base, BigId

# The Tinker API's tables, declared in a module of their own on the same Base: importing the
# models puts every table in Base.metadata (migrations, pool warm-up).
from app.core.tinker_tables import (  # noqa: F401
    TinkerCheckpoint,
    TinkerModel,
    TinkerRequest,
    TinkerSampler,
    TinkerSession,
)


class Timestamped:
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Project(Timestamped, Base):
    __tablename__ = "projects"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(120), unique=True)


class ApiKey(Timestamped, Base):
    """Only a SHA-256 digest of the secret is stored; the key is shown once at creation."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    secret_hash: Mapped[str] = mapped_column(String(64))
    name: Mapped[str | None] = mapped_column(String(120))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Dashboard sign-out: session tokens of this key issued at or before it are refused.
    sessions_valid_after: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class File(Timestamped, Base):
    """An uploaded JSONL dataset, stored in the database so every worker can read it."""

    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(Integer)
    row_count: Mapped[int] = mapped_column(Integer)
    rows: Mapped[list[Any]] = mapped_column(JSON)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str | None] = mapped_column(String(120))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)
    # The queue the job was sent to; every re-send (sweep, reaper, hand-over) goes back to it,
    # so a CPU worker's sweep never moves a GPU job onto the CPU queue.
    queue: Mapped[str] = mapped_column(String(200), default="grpo-jobs")
    # The spec's resources.devices, as a column so a project's device quota is one SUM
    # (app.jobs.quota); the queue above is that size class's (app.core.queue.queue_for).
    devices: Mapped[int] = mapped_column(Integer, default=1, server_default=literal_column("1"))
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancel_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    current_step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer, default=0)
    last_metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    step_started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    run_started_step: Mapped[int] = mapped_column(Integer, default=0)
    # Set for jobs created through /v1/fine_tuning/jobs: the request's own words (model as
    # named, suffix, hyperparameters with what "auto" resolved to); app.fine_tuning.service.
    openai: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Deleted by its owner (DELETE /v1/jobs/{id}, an ended job only): from then on no read of a
    # project finds it, and once the grace period has passed the maintenance pass purges its
    # checkpoints and rows (purged_at). Not a status: the job's outcome stays what it was.
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), index=True)
    purged_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_jobs_project_id_id", "project_id", "id"),)


def is_active(status: SQLColumnExpression[str]) -> ColumnElement[bool]:
    """`status IN ('queued', 'running', ...)`: the job is not finished (app.core.job_status
    .QUOTA_COUNTED_STATES), with the statuses written into the SQL. Literal values, not bound
    parameters: a planner can only prove that a query's rows are those of the partial index
    below when it sees the values, and the generic plan of a prepared statement (psycopg
    prepares what a connection runs often) does not."""
    return status.in_([literal_column(f"'{state.value}'") for state in QUOTA_COUNTED_STATES])


# A project's active jobs alone, with what the dispatch count needs: the quota count under the
# project's lock (app.jobs.quota.check_active_jobs) reads this index only, not every job the
# project ever had (BENCHMARKS.md, "API: job creation under load"); the queries meant to use it
# filter with the same `is_active`.
Index(
    "ix_jobs_active_project",
    Job.project_id,
    Job.dispatched_at,
    postgresql_where=is_active(Job.status),
    sqlite_where=is_active(Job.status),
)


class JobEvent(Base):
    __tablename__ = "job_events"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    type: Mapped[str] = mapped_column(String(64))
    level: Mapped[str] = mapped_column(String(16), default="info")
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class JobMetric(Base):
    """One row per (job, step): a resumed or re-delivered job can never write a step twice."""

    __tablename__ = "job_metrics"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_job_metrics_job_step"),)


class JobMetricRollup(Base):
    """Count, sum, min and max of one metric's finite values over the aligned block of steps
    ((block - 1) * level, block * level], kept up to date as steps arrive, so a chart read of
    any length touches a few thousand rows (app.progress.metrics_repository). Name "" counts steps."""

    __tablename__ = "job_metric_rollups"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    block: Mapped[int] = mapped_column(Integer, primary_key=True)
    count: Mapped[int] = mapped_column(Integer)
    total: Mapped[float]
    min: Mapped[float | None]
    max: Mapped[float | None]
    last_step: Mapped[int | None] = mapped_column(Integer)


class JobSample(Base):
    """A bounded sample of one step's rollouts (prompt, completions, rewards, advantages)."""

    __tablename__ = "job_samples"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    data: Mapped[list[Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_job_samples_job_step"),)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    # {keep_best_by metric: its value at or before this step} when the job ranks checkpoints.
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # The folder's size when recorded (null for checkpoints recorded before sizes were).
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # Deleted by the job's checkpoint retention: the folder is gone (or going), downloads 410.
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),)


class IdempotencyRecord(Base):
    """The first request with a key claims it (in_progress), then stores the response."""

    __tablename__ = "idempotency_records"
    project_id: Mapped[str] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    response_status: Mapped[int | None] = mapped_column(Integer)
    response_body: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebhookEndpoint(Timestamped, Base):
    """A project's webhook receiver. The signing secret is stored as issued (`whsec_...`): the
    worker signs every delivery with it, so a digest would not do; it is shown once at creation."""

    __tablename__ = "webhook_endpoints"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(String(2048))
    description: Mapped[str | None] = mapped_column(String(500))
    events: Mapped[list[Any]] = mapped_column(JSON)
    secret: Mapped[str] = mapped_column(String(100))
    __table_args__ = (Index("ix_webhook_endpoints_project_id_id", "project_id", "id"),)


class WebhookDelivery(Base):
    """The transactional outbox: one row per (event, endpoint), written in the transaction that
    changed the job, delivered by the workers (worker.webhooks). `id` is the `webhook-id` header:
    a retry or a redelivery sends the same id, so receivers can drop duplicates."""

    __tablename__ = "webhook_deliveries"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    job_id: Mapped[str | None] = mapped_column(String(40), index=True)
    event_type: Mapped[str] = mapped_column(String(40))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    # pending -> delivered | failed; a redelivery puts it back to pending.
    state: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # When a worker may (next) try it; a claim moves it past the attempt's timeout, so a worker
    # that dies mid-attempt leaves it due again once that passes.
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # Start of the retry window (creation or the last redelivery).
    queued_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    __table_args__ = (
        Index("ix_webhook_deliveries_endpoint_id_id", "endpoint_id", "id"),
        Index("ix_webhook_deliveries_state_next_attempt_at", "state", "next_attempt_at"),
    )


class WebhookAttempt(Base):
    """One try of a delivery: the answer's status code or the error, and how long it took."""

    __tablename__ = "webhook_attempts"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), index=True
    )
    attempt: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    duration_ms: Mapped[int] = mapped_column(Integer)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    # When the next try was scheduled (null: delivered, or given up).
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class InferenceServer(Base):
    """A running `grpo inference` process (inference/): where its control API answers, which base
    models it serves and what it holds warm. It rewrites its row every heartbeat; the gateway
    routes only to rows whose heartbeat is fresh (app.gateway.servers_repository)."""

    __tablename__ = "inference_servers"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    control_url: Mapped[str] = mapped_column(String(2048))
    # The base models it starts engines for (["*"]: any model the host can load).
    bases: Mapped[list[Any]] = mapped_column(JSON)
    # app.gateway.protocol.ServerState as JSON: engines, warm adapters, memory budget.
    state: Mapped[dict[str, Any]] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class InferenceUsage(Base):
    """Tokens served per project, model name and UTC day (GET /v1/usage; the daily token quota)."""

    __tablename__ = "inference_usage"
    project_id: Mapped[str] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True
    )
    model: Mapped[str] = mapped_column(String(1200), primary_key=True)
    day: Mapped[str] = mapped_column(String(10), primary_key=True)  # YYYY-MM-DD, UTC
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class WorkerSighting(Base):
    """A worker process as it last announced itself: its size class (devices) within its
    deployment's queues (GRPO_QUEUE_NAME), rewritten every maintenance pass (worker.maintenance).
    The API reads the recent ones to tell a job that no worker of its size runs
    (app.jobs.workers_repository); rows of workers gone for a week are deleted."""

    __tablename__ = "workers"
    name: Mapped[str] = mapped_column(String(300), primary_key=True)
    queue_name: Mapped[str] = mapped_column(String(200))
    devices: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # Tinker training clients it held when last seen (a waiting job's event names them).
    tinker_models: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Its device: "cuda" or "cpu", and one device's bytes (what the memory plan is for).
    device_kind: Mapped[str | None] = mapped_column(String(8), nullable=True)
    device_memory: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    __table_args__ = (Index("ix_workers_queue_name_last_seen_at", "queue_name", "last_seen_at"),)
