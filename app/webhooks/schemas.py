"""Request and response bodies of /v1/webhooks."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.webhooks.protocol import EventType
from app.webhooks.urls import MAX_URL_CHARS


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        min_length=1,
        max_length=MAX_URL_CHARS,
        description="An http:// or https:// URL that receives a POST per event.",
    )
    events: list[EventType] = Field(
        min_length=1, max_length=5, description="The event types to send (at least one)."
    )
    description: str | None = Field(default=None, max_length=500)

    @field_validator("events")
    @classmethod
    def _unique(cls, events: list[EventType]) -> list[EventType]:
        return list(dict.fromkeys(events))


class WebhookOut(BaseModel):
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    id: str
    url: str
    events: list[str]
    description: str | None
    created_at: datetime


class WebhookCreated(WebhookOut):
    secret: str = Field(
        description="The signing secret (`whsec_...`): shown only in this response. Verify "
        "deliveries with it (Standard Webhooks)."
    )


class WebhookList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookOut]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next page.")


class AttemptOut(BaseModel):
    attempt: int
    started_at: datetime
    duration_ms: int
    status_code: int | None = Field(description="The receiver's HTTP status, if it answered.")
    error: str | None = Field(description="Why the attempt failed, when it did not answer 2xx.")
    next_attempt_at: datetime | None = Field(description="When the next try was scheduled.")


class DeliveryOut(BaseModel):
    object: Literal["webhook_delivery"] = "webhook_delivery"
    id: str = Field(description="The `webhook-id` header: the same on every retry.")
    endpoint_id: str
    job_id: str | None
    event_type: str
    state: Literal["pending", "delivered", "failed"]
    attempts: int
    next_attempt_at: datetime | None = Field(description="When it is due (pending only).")
    delivered_at: datetime | None
    last_status_code: int | None
    last_error: str | None
    created_at: datetime
    payload: dict[str, Any] = Field(description="The body sent.")
    attempt_log: list[AttemptOut]


class DeliveryList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DeliveryOut]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next page.")
