"""The tables of the Tinker API (app/tinker, docs/tinker.md): sessions, the training models a
worker holds resident, their requests (futures), sampling sessions and saved checkpoints.

A Tinker training client is a model held by one worker for the life of its session
(worker/tinker_model.py): the API stores each call as a request row, the worker applies the
model's requests in arrival order (the SDK sends a model's calls one at a time, in ``seq_id``
order) and writes each result into its row; ``retrieve_future`` reads it back. Declared on the
same ``Base`` as every other table (app.core.model_base; ``app.core.models`` imports them).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.core.clock import utcnow
from app.core.model_base import Base, BigId


class TinkerSession(Base):
    """A client's session (``create_session``): alive while its heartbeats arrive."""

    __tablename__ = "tinker_sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    display_name: Mapped[str | None] = mapped_column(String(200))
    tags: Mapped[list[Any]] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    sdk_version: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finish_reason: Mapped[str | None] = mapped_column(String(32))

    __table_args__ = (Index("ix_tinker_sessions_project_id", "project_id"),)


class TinkerModel(Base):
    """A training client: ``{session_id}:train:{n}`` (the SDK derives the id itself). Its
    worker holds the model resident and a lease on this row (``lease_owner``, renewed
    ``heartbeat_at``); ``last_seq`` is the highest training ``seq_id`` accepted."""

    __tablename__ = "tinker_models"
    id: Mapped[str] = mapped_column(String(120), primary_key=True)
    session_id: Mapped[str] = mapped_column(
        ForeignKey("tinker_sessions.id", ondelete="CASCADE"), index=True
    )
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    base_model: Mapped[str] = mapped_column(String(300))  # as the client named it
    # The packaged model trained when base_model is an alias (GRPO_TINKER_MODEL_ALIASES), fixed
    # when the client is created so that its saves keep their model whatever the aliases
    # become; None: base_model itself. What workers load and the inference tier serves.
    trained_model: Mapped[str | None] = mapped_column(String(300))
    lora_rank: Mapped[int] = mapped_column(Integer)
    # train_attn / train_mlp / train_unembed / seed, as the request gave them.
    lora: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

    @property
    def model_trained(self) -> str:
        """The model the worker loads: the alias's packaged model, or base_model."""
        return self.trained_model or self.base_model

    # starting (queued for a worker) -> ready (resident) -> closed | failed; ready ->
    # released (idle: written to ``idle_state``, no worker) -> starting (its next call).
    status: Mapped[str] = mapped_column(String(16), default="starting")
    # When the model last went to the queue (created, or called again once released): the
    # claim timeout counts from here. None: created_at (rows older than the release).
    queued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Its last message to the workers' queue (the maintenance sweep sends a waiting one again).
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The folder a released model was written to (weights, Adam state, gradients, sampler
    # weights): what the next worker loads.
    idle_state: Mapped[str | None] = mapped_column(String(1000))
    # A model created by load_weights starts from this saved state (a checkpoint folder).
    restore_from: Mapped[str | None] = mapped_column(String(1000))
    restore_optimizer: Mapped[bool] = mapped_column(default=True)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_seq: Mapped[int] = mapped_column(Integer, default=0)
    last_saved_path: Mapped[str | None] = mapped_column(String(1000))
    # The local folder the worker loaded (its tokenizer is what get_info names to the SDK).
    model_folder: Mapped[str | None] = mapped_column(String(1000))
    error_message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_request_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TinkerRequest(Base):
    """One call that returns a future. ``position`` is the arrival order the worker applies a
    model's requests in; ``request_id`` is what the client polls. ``body`` is the call's own
    bytes (JSON, or protobuf for forward_backward); ``result`` is what retrieve_future returns
    (JSON or protobuf, ``result_format``)."""

    __tablename__ = "tinker_requests"
    position: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(48), unique=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    model_id: Mapped[str] = mapped_column(String(120))
    # Training calls: the model's seq_id; samples: "sample:<sampler>:<seq>" dedupe key below.
    seq_key: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    # Dropped (None) once the call is applied or refused.
    body: Mapped[bytes | None] = mapped_column(LargeBinary)
    status: Mapped[str] = mapped_column(String(16), default="queued")  # queued|done|failed
    result: Mapped[bytes | None] = mapped_column(LargeBinary)
    result_format: Mapped[str | None] = mapped_column(String(8))  # json | proto
    error: Mapped[str | None] = mapped_column(Text)
    error_category: Mapped[str | None] = mapped_column(String(16))  # user | server
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The bytes of body and result still held: counted against the project's stored bytes.
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    # When the client first read the result (it is dropped a little later).
    retrieved_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        # A retried call (same seq_id) finds its first request instead of making a second.
        UniqueConstraint("model_id", "seq_key", name="uq_tinker_requests_model_seq"),
        Index("ix_tinker_requests_model_status", "model_id", "status", "position"),
        # A project's calls over a window (GET /v1/usage).
        Index("ix_tinker_requests_project_created", "project_id", "created_at"),
    )


class TinkerSampler(Base):
    """A sampling session ``{session_id}:sample:{n}``: the weights of a save of a training model
    (``model_id`` and ``weights``: the snapshot's name), sampled by that model's worker."""

    __tablename__ = "tinker_samplers"
    id: Mapped[str] = mapped_column(String(120), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("tinker_sessions.id", ondelete="CASCADE"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    base_model: Mapped[str] = mapped_column(String(300))
    model_id: Mapped[str | None] = mapped_column(String(120))
    model_path: Mapped[str | None] = mapped_column(String(1000))  # tinker://..., when named
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TinkerCheckpoint(Base):
    """A saved state (``weights``: weights and optimizer) or sampler weights of a training
    model, listed per training run; ``folder`` is where the worker wrote it."""

    __tablename__ = "tinker_checkpoints"
    model_id: Mapped[str] = mapped_column(String(120), primary_key=True)
    kind: Mapped[str] = mapped_column(String(24), primary_key=True)  # weights | sampler_weights
    name: Mapped[str] = mapped_column(String(120), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    folder: Mapped[str] = mapped_column(String(1000))
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
