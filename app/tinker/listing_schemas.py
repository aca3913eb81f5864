"""Response bodies of GET /v1/tinker/sessions (app.tinker.listing_routes): a project's Tinker
sessions and their training clients, as the dashboard lists them."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

SessionState = Literal["live", "finished", "expired"]


class TinkerModelOut(BaseModel):
    object: Literal["tinker.training_client"] = "tinker.training_client"
    id: str = Field(description="`{session_id}:train:{n}`, the id the SDK knows.")
    base_model: str
    lora_rank: int
    status: str = Field(
        description="starting (waiting for a worker), ready (resident on a worker), released "
        "(quiet for GRPO_TINKER_IDLE_RELEASE_S: written to disk, its worker freed; its next "
        "call loads it again), closed (its session ended) or failed (`error_message`)."
    )
    live: bool = Field(
        description="starting, ready or released: it counts against the project's quota."
    )
    created_at: datetime
    last_request_at: datetime = Field(description="When its latest call was accepted.")
    last_saved_path: str | None = Field(
        description="Its latest `save_state` (`tinker://<model>/weights/<name>`): what a "
        "restore continues from."
    )
    error_message: str | None
    calls_applied: int = Field(description="Calls its worker applied (their futures done).")
    calls_failed: int
    calls_queued: int = Field(description="Calls accepted and not applied yet.")
    applied_by_kind: dict[str, int] = Field(
        description="`calls_applied` per kind (create_model, forward_backward, forward, "
        "optim_step, save_weights, save_weights_for_sampler, load_weights, sample)."
    )


class TinkerSessionOut(BaseModel):
    object: Literal["tinker.session"] = "tinker.session"
    id: str
    display_name: str | None
    tags: list[str]
    sdk_version: str | None
    created_at: datetime
    heartbeat_at: datetime = Field(description="The client's latest heartbeat.")
    finished_at: datetime | None
    finish_reason: str | None
    status: SessionState = Field(
        description="live (heartbeats arrive), finished (the client closed it) or expired (no "
        "heartbeat for GRPO_TINKER_SESSION_TTL_S)."
    )
    live: bool
    model_count: int = Field(description="Training clients the session created.")
    models: list[TinkerModelOut] = Field(
        description="Its newest training clients (at most 20), oldest first."
    )


class TinkerSessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TinkerSessionOut]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next page.")
